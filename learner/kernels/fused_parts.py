"""What the fused kernels share: the padded state layout and the jitted pieces of one training step.

The kernels (one per file) are built from these pieces:

    fused_train.py    one program trains one task end to end (the ``fused`` backend's kernel)
    fused_rows.py     the split variant: a step's minibatch rows over several programs ...
    fused_update.py   ... then each weight's gradient summed and updated by a program of its own
    fused_predict.py  the queries of a trained task, spread over many programs

Padded layout (``pack_state``): each half of the 82 features is padded 41 -> 64 lanes and the 10
classes to 16. One task's state is a flat float32 vector of ``state_size(depth)``:

    W[k]   k = 0..2d-1   (64, 64)   W[k][i, j] = weights.k[i, j]          for i, j < 41
    HL                   (16, 64)   HL[c, j]   = head.weight[c, j]        for c < 10, j < 41
    HR                   (16, 64)   HR[c, j]   = head.weight[c, 41 + j]   for c < 10, j < 41
    bias                 (16,)      bias[c]    = head.bias[c]             for c < 10

Why the padded lanes stay exactly zero: padded input lanes are loaded as 0 (not -0.5), a padded
weight row/column multiplies or produces only zero lanes, so every gradient of a padded entry is a
sum of products with a zero factor (exactly 0), its velocity stays 0 and so does the entry. Padded
classes get score -inf before the softmax, hence probability 0 and gradient 0. Padded rows of a
chunk are lifted as zeros and get gradient 0. ``unpack_state`` checks the padded lanes on every
run and fails loudly if one is not 0.

Products: every matrix product is a loop of ``tl.dot`` over 16-wide slices of the reduction
dimension, reading both operands from memory: weights from the state, activations and gradients
from the program's scratch (``_stage``). ``_mm``: a reduction of compile-time length (48 feature
lanes, 41 real + zero padding, or the 16 class lanes), one row's result computed from that row
alone. ``grad_rows``: a weight gradient, a sum over the minibatch's rows in one fixed order (one
accumulator carried down the rows, 16 at a time, from chunk to chunk), whatever the chunk, the
number of warps or the variant. (Triton folds ``acc + tl.dot(a, b)`` into ``tl.dot(a, b, acc)``
when it compiles for a GPU -- the interpreter does not -- so every sum here is written in the
form the GPU runs.) Slicing matters for speed too: a plain 128x64 @ 64x64 ``tl.dot``
with fp32 operands is lowered to FMAs that hold the whole reduction dimension in registers (255
registers and spills for one product on sm_90), while K = 16 slices need ~85.

One arithmetic for every variant: each row's values come from that row alone, every sum has a
fixed order (over rows: ``grad_rows`` and ``bias_rows``; over the 16 class lanes: ``_row_sums``,
an FMA chain, where ``tl.sum`` would add in an order that follows the register layout, which
depends on CHUNK and the number of warps). So a task's bytes depend on its data, its config and
the product precision only: a lone task on the split variant (fused_rows.py) equals the same
task in a launch of 132 on the one-program kernel, byte for byte, and the tuning run may choose
chunk, warps and variant per GPU without changing any answer (tests/test_fused.py checks it in
the interpreter; scripts/gpu_tune.py on the GPU).

``PRECISION`` is ``tl.dot``'s ``input_precision``: ``"ieee"`` (fp32 FMAs) or ``"tf32x3"``
(three TF32 tensor-core products per product, the error of fp32 in practice: the tuning run,
scripts/gpu_tune.py, checks every query of the eleven draws before a GPU may use it). Triton's
interpreter ignores it (numpy computes in fp32 either way).

Loops whose length is known only at run time are ``while`` loops: Triton's interpreter turns a
``range`` bound into a Python int with ``int(tensor)``, which Triton 3.6 does on a one-element
array -- an error since numpy 2.5 ("only 0-dimensional arrays can be converted to Python
scalars"); a ``while`` condition only needs ``bool``, which every numpy allows. Compiled, both
are the same loop.
"""

from __future__ import annotations

import functools

import numpy as np
import triton
import triton.language as tl

from .tuned import PRECISIONS  # tl.dot input precisions the kernels are built for

WIDTH = 41  # real lanes of one half (the model's WIDTH)
HALF = 64  # padded lanes of one half
CLASSES = 10
CLASS_PAD = 16
PIXELS = 81
W_SIZE = HALF * HALF  # one padded branch weight
H_SIZE = CLASS_PAD * HALF  # one padded head half


def state_size(depth: int) -> int:
    return 2 * depth * W_SIZE + 2 * H_SIZE + CLASS_PAD


def scratch_size(chunk: int) -> int:
    """Per-program staging: two (chunk, 64) activation/gradient tiles and one (chunk, 16)."""
    return 2 * chunk * HALF + chunk * CLASS_PAD


def rows_size(depth: int, bpad: int) -> int:
    """The split variant's kept operands of one task's minibatch (``rows_layout``), in floats."""
    return (4 * depth * HALF + CLASS_PAD + 2 * HALF) * bpad


def rows_layout(depth: int, bpad: int) -> dict[str, int]:
    """Where fused_rows.py keeps each product's operands (float offsets; every block has ``bpad``
    rows): for weight k, a = alpha*relu(input) at block 2k and the gradient g at block 2k+1, each
    (bpad, 64); then the head's g (bpad, 16), left and right (bpad, 64)."""
    head = 4 * depth * HALF * bpad
    return {"weights": 0, "head_g": head, "head_left": head + CLASS_PAD * bpad,
            "head_right": head + (CLASS_PAD + HALF) * bpad}


def data_rows(data_index, data):
    """A launch's dataset index: task t reads row ``data_index[t]`` of the data tensors (train, labels,
    test: one row per dataset, so the tasks of a launch that share a dataset resident on the device
    read one copy of it); None: each task its own row (row t), a fresh int32 tensor on ``data``'s device.
    Only where a task's data is read depends on it, never the arithmetic."""
    if data_index is not None:
        return data_index
    import torch

    return torch.arange(int(data.shape[0]), dtype=torch.int32, device=data.device)


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


# --------------------------------------------------------------------------- jitted pieces


@triton.jit
def _lift(img_ptr, rows, ok, j):
    """Rows ``rows`` of (., 81) raw pixels -> the two lifted halves (CHUNK, 64) each.

    h = 4*x - 0.5 for the 81 pixels; feature 81 is the appended zero; padded lanes are 0.
    """
    lmask = ok[:, None] & (j[None, :] < 41)  # left: pixels 0..40
    x = tl.load(img_ptr + rows[:, None] * 81 + j[None, :], mask=lmask, other=0.0)
    left = tl.where(lmask, x * 4.0 - 0.5, 0.0)
    rmask = ok[:, None] & (j[None, :] < 40)  # right: pixels 41..80, then the zero feature
    x = tl.load(img_ptr + rows[:, None] * 81 + 41 + j[None, :], mask=rmask, other=0.0)
    right = tl.where(rmask, x * 4.0 - 0.5, 0.0)
    return left, right


@triton.jit
def _mm(a_ptr, a_sm, a_sk, b_ptr, b_sk, b_sn, K: tl.constexpr, M: tl.constexpr, N: tl.constexpr,
        PRECISION: tl.constexpr):
    """C[m, n] = sum_{k < K} A[m, k] * B[k, n], A and B read from memory by strides; K a multiple of 16."""
    m = tl.arange(0, M)
    n = tl.arange(0, N)
    kk = tl.arange(0, 16)
    acc = tl.zeros([M, N], dtype=tl.float32)
    for k0 in range(0, K, 16):
        a = tl.load(a_ptr + m[:, None] * a_sm + (k0 + kk)[None, :] * a_sk)
        b = tl.load(b_ptr + (k0 + kk)[:, None] * b_sk + n[None, :] * b_sn)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def grad_rows(G, offs, a_ptr, a_sm, a_sk, b_ptr, b_sk, b_sn, k_end, c0, M: tl.constexpr, N: tl.constexpr,
               PRECISION: tl.constexpr):
    """G <- G + sum_k A[m, k] * B[k, n] over k < k_end (a chunk's real rows rounded up to 16): a
    weight gradient, summed over the minibatch's rows in one order -- ``tl.dot``'s accumulator runs
    on from slice to slice, from chunk to chunk (G read as 0 on the minibatch's first chunk,
    ``c0 == 0``; the store and load between chunks are exact). Compiled, each (m, n) is one fp32
    FMA chain down the rows (Triton would fold ``acc + tl.dot(a, b)`` into this form anyway), so
    the result does not depend on CHUNK or the number of warps; fused_update.py runs this same
    function over a whole minibatch at once and gets the same bytes."""
    m = tl.arange(0, M)
    n = tl.arange(0, N)
    kk = tl.arange(0, 16)
    acc = tl.load(G + offs, mask=offs * 0 + c0 > 0, other=0.0)
    k0 = k_end * 0
    while k0 < k_end:
        a = tl.load(a_ptr + m[:, None] * a_sm + (k0 + kk)[None, :] * a_sk)
        b = tl.load(b_ptr + (k0 + kk)[:, None] * b_sk + n[None, :] * b_sn)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        k0 += 16
    tl.store(G + offs, acc)


@triton.jit
def bias_rows(G, XG, k_end, c0):
    """The head bias's gradient, the sum over rows of g (staged in XG, (rows, 16)): per 16-row
    slice ``ones(16, 16) @ g[slice]`` (an fp32 FMA chain down the slice; every row of the product is
    the slice's column sums: row 0 is taken, exactly), added to the sum of the earlier slices."""
    kk = tl.arange(0, 16)
    c = tl.arange(0, 16)
    ones = tl.full([16, 16], 1.0, tl.float32)
    acc = tl.load(G + c, mask=c * 0 + c0 > 0, other=0.0)
    k0 = k_end * 0
    while k0 < k_end:
        s = tl.dot(ones, tl.load(XG + (k0 + kk)[:, None] * 16 + c[None, :]), input_precision="ieee")
        acc = acc + tl.sum(tl.where(kk[:, None] == 0, s, 0.0), axis=0)
        k0 += 16
    tl.store(G + c, acc)


@triton.jit
def _keep(R, rows, lanes, tile, LANES: tl.constexpr):
    """Store a (CHUNK, LANES) register tile at rows ``rows`` of the (rows, LANES) block R."""
    tl.store(R + rows[:, None] * LANES + lanes[None, :], tile)


@triton.jit
def _row_sums(x):
    """(ROWS, 16) -> (ROWS, 16) whose every column is the row's sum: ``x @ ones``, an fp32 FMA chain
    along the row (a ``tl.sum`` would add in an order that depends on the register layout, hence
    on CHUNK and the number of warps)."""
    return tl.dot(x, tl.full([16, 16], 1.0, tl.float32), input_precision="ieee")


@triton.jit
def _stage(ptr, x, r, lanes, LANES: tl.constexpr):
    """Write a (CHUNK, LANES) register tile row-major to scratch for the products to read."""
    tl.debug_barrier()  # everyone has finished reading the previous contents
    tl.store(ptr + r[:, None] * LANES + lanes[None, :], x)
    tl.debug_barrier()  # the whole tile is written before anyone reads it


@triton.jit
def sgd_update(p_ptrs, v_ptrs, g_ptrs, mask, lr, momentum, weight_decay, HAS_WD: tl.constexpr):
    """torch.optim.SGD with momentum (dampening 0, no nesterov), in place."""
    p = tl.load(p_ptrs, mask=mask, other=0.0)
    g = tl.load(g_ptrs, mask=mask, other=0.0)
    if HAS_WD:
        g = g + weight_decay * p
    v = tl.load(v_ptrs, mask=mask, other=0.0) * momentum + g
    tl.store(v_ptrs, v, mask=mask)
    tl.store(p_ptrs, p - lr * v, mask=mask)


@triton.jit
def _core_forward(P, XA, left, right, r, j, alpha, DEPTH: tl.constexpr, CHUNK: tl.constexpr,
                  PRECISION: tl.constexpr):
    """left += alpha*relu(right) @ W[2b].T ; right += alpha*relu(left) @ W[2b+1].T  (model.core_forward)."""
    for b in range(DEPTH):  # a loop, not unrolled: one copy of the block's code
        # (x @ W.T)[m, n] = sum_k x[m, k] * W[n, k]: B[k, n] at W + n*64 + k
        _stage(XA, alpha * tl.maximum(right, 0.0), r, j, 64)
        left = left + _mm(XA, 64, 1, P + (2 * b) * 4096, 1, 64, 48, CHUNK, 64, PRECISION)
        _stage(XA, alpha * tl.maximum(left, 0.0), r, j, 64)
        right = right + _mm(XA, 64, 1, P + (2 * b + 1) * 4096, 1, 64, 48, CHUNK, 64, PRECISION)
    return left, right


@triton.jit
def _head(P, XA, XB, left, right, r, j, c, DEPTH: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """scores (CHUNK, 16) = left @ HL.T + right @ HR.T + bias; leaves left in XA, right in XB."""
    HEAD: tl.constexpr = 2 * DEPTH * 4096
    tl.debug_barrier()
    tl.store(XA + r[:, None] * 64 + j[None, :], left)
    tl.store(XB + r[:, None] * 64 + j[None, :], right)
    tl.debug_barrier()
    s = _mm(XA, 64, 1, P + HEAD, 1, 64, 48, CHUNK, 16, PRECISION)
    s = s + _mm(XB, 64, 1, P + HEAD + 1024, 1, 64, 48, CHUNK, 16, PRECISION)
    return s + tl.load(P + HEAD + 2048 + c)[None, :]


@triton.jit
def chunk_gradients(P, G, XA, XB, XG, train, labels, order, c0, rows_in_batch, inv_b, alpha, R, bpad,
                     r, j, c, w_off, h_off, cls_ok, DEPTH: tl.constexpr, CHUNK: tl.constexpr,
                     PRECISION: tl.constexpr, ROWS: tl.constexpr):
    """One chunk of a minibatch: rows ``order[c0 : c0 + CHUNK]`` (those below ``rows_in_batch``)
    forward and back. ROWS false (one program trains the task): the weight gradients into G by
    ``grad_rows`` and ``bias_rows``, summed with the minibatch's earlier chunks. ROWS true (the
    split variant's rows phase, fused_rows.py): the operands of those products kept instead, at
    rows c0.. of the blocks of R (``rows_layout``, ``bpad`` rows each), for fused_update.py to sum
    in the same order. ``inv_b`` = 1 / rows in the minibatch; the index vectors from ``chunk_indices``.

    Every value of one row (its forward, softmax, backward) is computed by that row alone, and
    every sum over rows or lanes has a fixed order (``grad_rows``, ``bias_rows``, ``_row_sums``),
    so the result is the same bytes for any CHUNK, number of warps and variant."""
    HEAD: tl.constexpr = 2 * DEPTH * 4096
    ok = c0 + r < rows_in_batch
    k_rows = tl.cdiv(tl.minimum(rows_in_batch - c0, CHUNK), 16) * 16  # row reductions stop here
    idx = tl.load(order + c0 + r, mask=ok, other=0)  # gather by the epoch's permutation
    y = tl.load(labels + idx, mask=ok, other=0)
    left, right = _lift(train, idx, ok, j)

    # forward; only the endpoint (left, right) is kept
    left, right = _core_forward(P, XA, left, right, r, j, alpha, DEPTH, CHUNK, PRECISION)
    s = tl.where(cls_ok, _head(P, XA, XB, left, right, r, j, c, DEPTH, CHUNK, PRECISION), float("-inf"))

    # cross-entropy gradient: softmax(s)/B - onehot(y)/B on real rows, 0 elsewhere
    e = tl.exp(s - tl.max(s, axis=1)[:, None])
    prob = tl.div_rn(e, _row_sums(e))
    onehot = c[None, :] == y[:, None]
    g = prob * inv_b - tl.where(onehot, inv_b, 0.0)
    g = tl.where(ok[:, None] & cls_ok, g, 0.0)
    _stage(XG, g, r, c, 16)

    # head: dHL = g.T @ left, dHR = g.T @ right (left, right staged by _head), dbias = sum(g)
    if ROWS:
        RH = R + (4 * DEPTH) * bpad * 64  # g (bpad, 16), then left and right (bpad, 64) each
        _keep(RH, c0 + r, c, g, 16)
        _keep(RH + bpad * 16, c0 + r, j, left, 64)
        _keep(RH + bpad * 80, c0 + r, j, right, 64)
    else:
        grad_rows(G + HEAD, h_off, XG, 1, 16, XA, 64, 1, k_rows, c0, 16, 64, PRECISION)
        grad_rows(G + HEAD + 1024, h_off, XG, 1, 16, XB, 64, 1, k_rows, c0, 16, 64, PRECISION)
        bias_rows(G + HEAD + 2048, XG, k_rows, c0)
    # gradients into the core: g @ HL, g @ HR  (B[k, n] = H[k, n] at k*64 + n)
    g_left = _mm(XG, 16, 1, P + HEAD, 64, 1, 16, CHUNK, 64, PRECISION)
    g_right = _mm(XG, 16, 1, P + HEAD + 1024, 64, 1, 16, CHUNK, 64, PRECISION)

    # reversible backward (model.ReversibleCore.backward), blocks in reverse
    for i in range(DEPTH):
        b = DEPTH - 1 - i
        w_l = P + (2 * b) * 4096
        w_r = P + (2 * b + 1) * 4096
        # right_out = right_in + branch(left_out, w_r): recover right_in, then
        # dW_r = g_right.T @ a (a = alpha*relu(left)), d left += relu'(left)*alpha*(g_right @ W_r)
        tl.debug_barrier()
        tl.store(XA + r[:, None] * 64 + j[None, :], alpha * tl.maximum(left, 0.0))
        tl.store(XB + r[:, None] * 64 + j[None, :], g_right)
        tl.debug_barrier()
        right = right - _mm(XA, 64, 1, w_r, 1, 64, 48, CHUNK, 64, PRECISION)
        if ROWS:  # the operands of dW[2b+1]: a at block 2(2b+1), g at block 2(2b+1)+1
            _keep(R + (4 * b + 2) * bpad * 64, c0 + r, j, alpha * tl.maximum(left, 0.0), 64)
            _keep(R + (4 * b + 3) * bpad * 64, c0 + r, j, g_right, 64)
        else:
            grad_rows(G + (2 * b + 1) * 4096, w_off, XB, 1, 64, XA, 64, 1, k_rows, c0, 64, 64, PRECISION)
        g_left = g_left + tl.where(left > 0.0, _mm(XB, 64, 1, w_r, 64, 1, 48, CHUNK, 64, PRECISION) * alpha, 0.0)
        # left_out = left_in + branch(right_in, w_l): the same with the roles swapped
        tl.debug_barrier()
        tl.store(XA + r[:, None] * 64 + j[None, :], alpha * tl.maximum(right, 0.0))
        tl.store(XB + r[:, None] * 64 + j[None, :], g_left)
        tl.debug_barrier()
        if ROWS:  # the operands of dW[2b]
            _keep(R + (4 * b) * bpad * 64, c0 + r, j, alpha * tl.maximum(right, 0.0), 64)
            _keep(R + (4 * b + 1) * bpad * 64, c0 + r, j, g_left, 64)
        else:
            grad_rows(G + (2 * b) * 4096, w_off, XB, 1, 64, XA, 64, 1, k_rows, c0, 64, 64, PRECISION)
        if b > 0:  # block 0's input (the lifted batch) needs neither value nor gradient
            left = left - _mm(XA, 64, 1, w_l, 1, 64, 48, CHUNK, 64, PRECISION)
            g_right = g_right + tl.where(
                right > 0.0, _mm(XB, 64, 1, w_l, 64, 1, 48, CHUNK, 64, PRECISION) * alpha, 0.0
            )
    tl.debug_barrier()


@triton.jit
def predict_chunk(P, XA, XB, test, scores, q0, n_test, alpha, r, j, c, cls_ok, DEPTH: tl.constexpr,
                   CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """Plain forward of queries q0 .. q0 + CHUNK - 1 (those below n_test); their 10 real scores out."""
    rows = q0 + r
    ok = rows < n_test
    left, right = _lift(test, rows, ok, j)
    left, right = _core_forward(P, XA, left, right, r, j, alpha, DEPTH, CHUNK, PRECISION)
    s = _head(P, XA, XB, left, right, r, j, c, DEPTH, CHUNK, PRECISION)
    tl.store(scores + rows[:, None] * 10 + c[None, :], s, mask=ok[:, None] & cls_ok)


@triton.jit
def chunk_indices(CHUNK: tl.constexpr):
    """r: row within a chunk; j: lane within a half; c: class lane; the (64, 64) offsets of one
    branch weight; the (16, 64) offsets of one head half; which class lanes are real."""
    r = tl.arange(0, CHUNK)
    j = tl.arange(0, 64)
    c = tl.arange(0, 16)
    return r, j, c, j[:, None] * 64 + j[None, :], c[:, None] * 64 + j[None, :], c[None, :] < 10


# --------------------------------------------------------------------------- host-side layout


def pack_state(params: list[np.ndarray], depth: int) -> np.ndarray:
    """Parameters in model order (weights.0..2d-1, head.weight, head.bias) -> padded flat state."""
    if len(params) != 2 * depth + 2:
        raise ValueError(f"expected {2 * depth + 2} parameter arrays for depth {depth}, got {len(params)}")
    out = np.zeros(state_size(depth), dtype=np.float32)
    for k in range(2 * depth):
        w = np.asarray(params[k], dtype=np.float32)
        if w.shape != (WIDTH, WIDTH):
            raise ValueError(f"weights.{k} must have shape (41, 41), got {w.shape}")
        out[k * W_SIZE : (k + 1) * W_SIZE].reshape(HALF, HALF)[:WIDTH, :WIDTH] = w
    hw, hb = np.asarray(params[-2], dtype=np.float32), np.asarray(params[-1], dtype=np.float32)
    if hw.shape != (CLASSES, 2 * WIDTH) or hb.shape != (CLASSES,):
        raise ValueError(f"head must be (10, 82) and (10,), got {hw.shape} and {hb.shape}")
    head = 2 * depth * W_SIZE
    out[head : head + H_SIZE].reshape(CLASS_PAD, HALF)[:CLASSES, :WIDTH] = hw[:, :WIDTH]
    out[head + H_SIZE : head + 2 * H_SIZE].reshape(CLASS_PAD, HALF)[:CLASSES, :WIDTH] = hw[:, WIDTH:]
    out[head + 2 * H_SIZE : head + 2 * H_SIZE + CLASSES] = hb
    return out


@functools.cache
def padding_mask(depth: int) -> np.ndarray:
    """(state_size(depth),) bool: True where a lane of the padded state is padding (read-only): the
    padding's definition, which ``unpack_states`` reads as regions in place (tests/test_fused.py
    holds the two together lane by lane)."""
    pad = np.ones(state_size(depth), dtype=bool)
    for k in range(2 * depth):
        pad[k * W_SIZE : (k + 1) * W_SIZE].reshape(HALF, HALF)[:WIDTH, :WIDTH] = False
    head = 2 * depth * W_SIZE
    pad[head : head + H_SIZE].reshape(CLASS_PAD, HALF)[:CLASSES, :WIDTH] = False
    pad[head + H_SIZE : head + 2 * H_SIZE].reshape(CLASS_PAD, HALF)[:CLASSES, :WIDTH] = False
    pad[head + 2 * H_SIZE : head + 2 * H_SIZE + CLASSES] = False
    pad.flags.writeable = False
    return pad


def unpack_states(states: np.ndarray, depth: int, what: str = "state") -> list[list[np.ndarray]]:
    """(T, state_size) padded flat states -> each task's arrays in model order; raises if any padded
    lane of any of them is not exactly 0 (checked for the T states at once). Each kind of array is
    cut out of the T states in one copy; a task's arrays are views of those copies (a task's own
    copies cost ~20 us a task of the device worker's time, 5 ms for a 132-task launch)."""
    states = np.asarray(states, dtype=np.float32)
    if states.ndim != 2 or states.shape[1] != state_size(depth):
        raise ValueError(f"{what} must have shape (T, {state_size(depth)}), got {states.shape}")
    t, blocks, head = states.shape[0], 2 * depth, 2 * depth * W_SIZE
    padded = states[:, :head].reshape(t, blocks, HALF, HALF)
    halves = states[:, head : head + 2 * H_SIZE].reshape(t, 2, CLASS_PAD, HALF)
    # the padding is these regions (padding_mask's lanes, read in place: no copy of the T states)
    padding = (padded[:, :, :WIDTH, WIDTH:], padded[:, :, WIDTH:, :], halves[:, :, :CLASSES, WIDTH:],
               halves[:, :, CLASSES:, :], states[:, head + 2 * H_SIZE + CLASSES :])
    if any(part.any() for part in padding):
        nonzero = sum(np.count_nonzero(part) for part in padding)
        raise RuntimeError(f"fused kernel bug: {nonzero} padded lane(s) of the {what} are not exactly zero")
    weights = np.ascontiguousarray(padded[:, :, :WIDTH, :WIDTH])
    left, right = halves[:, 0, :CLASSES, :WIDTH], halves[:, 1, :CLASSES, :WIDTH]
    head_weight = np.concatenate([left, right], axis=2)  # (T, 10, 82): the head's two halves side by side
    head_bias = states[:, head + 2 * H_SIZE : head + 2 * H_SIZE + CLASSES].copy()
    return [[*weights[i], head_weight[i], head_bias[i]] for i in range(t)]


def unpack_state(state: np.ndarray, depth: int, what: str = "state") -> list[np.ndarray]:
    """Padded flat state -> arrays in model order; raises if any padded lane is not exactly 0."""
    state = np.asarray(state, dtype=np.float32)
    if state.shape != (state_size(depth),):
        raise ValueError(f"{what} must have shape ({state_size(depth)},), got {state.shape}")
    return unpack_states(state[None], depth, what)[0]
