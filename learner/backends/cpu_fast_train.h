/*
 * The cpu-fast kernel: one call trains one rev88 task end to end and scores its queries.
 *
 * Same math as learner/train.py + learner/model.py (the cpu backend), written out by hand:
 *
 *   lift      h = [4*x - 0.5, 0]; left = h[:41], right = h[41:]
 *   block b   left  += (alpha*relu(right)) @ W[2b].T
 *             right += (alpha*relu(left))  @ W[2b+1].T
 *   head      s = [left, right] @ hw.T + hb;  loss = mean cross-entropy
 *   backward  reversible: only the core's endpoint is kept; each earlier state is rebuilt by
 *             subtracting the branch it added (as learner.model.ReversibleCore does)
 *   update    g (+= wd*p); v = momentum*v + g; p -= lr*v      (torch.optim.SGD order)
 *
 * Everything is row-local except the weight gradients (sums over the batch), so each
 * minibatch runs in two phases:
 *   rows     the minibatch's rows are lifted (and the next minibatch's prefetched); then
 *            per row: forward, loss gradient, reversible backward; each branch's input
 *            activation, output gradient and active inputs (as bits) are saved
 *   update   per weight column (and head class): gradient, SGD step, working copies
 * All buffers are allocated once per call; nothing is allocated per step; no BLAS, no
 * autograd. The weights are trained column-major inside (wp[c][j] = W[j][c]) and written
 * back in torch's layout at the end.
 *
 * Layout: a 41-wide half state is padded to 48 floats (six 8-float vectors); the padding
 * stays exactly zero (the padded weight columns are zero), so it never changes a result.
 * relu zeroes most of each branch's inputs (on MNIST draw 0 about 10 of 41 pass), and the
 * kernel skips them everywhere, walking the set bits of relu's mask: the
 * products and weight gradients leave out exact-zero terms (0*w is an exact zero for finite
 * w), and the gradient to a branch's input is computed only where relu passes it (as dot
 * products with the columns of W; elsewhere it is zero by the mask). The first
 * reconstruction of the backward subtracts the very product the forward added last (same
 * inputs, same bits), so it is kept rather than recomputed; the last one (the lifted input
 * itself) is never needed, so only its branch's activation is computed.
 *
 * Summation order differs from MKL's, so results equal the cpu backend's to float32
 * rounding (the tests bound the difference), and they are bit-for-bit repeatable on one
 * machine: every sum runs in a fixed order, whatever the thread count.
 *
 * Threads: with threads > 1, rows of a minibatch (and the queries) and the update's
 * columns are split over that many pthreads that meet at a barrier after each phase (two
 * per minibatch). Each output element is computed by one thread in a fixed order, so the
 * result does not depend on the thread count.
 *
 * Stopping early: once per minibatch the run checks the caller's cancel flag and whether the
 * head bias is still finite (a flag read and ten compares: nothing measurable), and returns
 * CPU_FAST_CANCELLED or CPU_FAST_DIVERGED with the minibatch in stop_at. Every thread acts on
 * the same readings after the same barrier, so all stop at the same minibatch.
 *
 * This file is compiled once per CPU variant (cpu_fast_generic.c, cpu_fast_x86_64_v3.c), each
 * defining KERNEL_ENTRY; the Python glue (cpu_fast_kernel.c) picks the variant for the CPU at
 * hand. Where __AVX2__ is defined (the x86-64-v3 variant) relu's mask is taken with AVX2
 * compares and movemask; elsewhere with portable vector code. Measured on the dev machine
 * (draw-0 task, one thread): x86-64-v3 ~16-36 ms depending on the host's load; the generic
 * variant on x86-64 is SSE2 only and several times slower, still faster than the cpu backend.
 *
 * How it was tuned: instructions per draw-0 call counted exactly with valgrind's callgrind
 * (the dev VM's timings swing by +-30% with its neighbours' load), stalls located with perf.
 * What paid: walking mask bits instead of packed index lists (-10% instructions), grouped
 * reductions in grad_input, keeping loop accumulators out of the stack (GCC spilled twelve
 * accumulators over a long inlined loop; six per loop stay in registers), lifting and
 * prefetching rows a minibatch at a time (perf had put 5-8% of samples on the shuffled row
 * reads; afterwards reading them in order instead was no faster).
 * What did not: pairing rows in lockstep, dense products, a dense weight gradient, a
 * branch-free odd tail in the products (more instructions and mispredictions, measured).
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_fast.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define PAD 48 /* padded half state */
#define NV 6   /* 8-float vectors per padded half */
#define ROW 96 /* padded state: left at [0, 48), right at [48, 96) */
#define CPAD 16

typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));

#define INLINE static inline __attribute__((always_inline))

/* ------------------------------------------------------------------------ task state */

typedef struct {
    /* sizes and config */
    int64_t n, m, epochs, batch, depth, nparams;
    float alpha, lr, momentum, wd;
    int threads;
    /* inputs */
    const float *train_x, *test_x;
    const int64_t *labels, *perms;
    /* outputs (params in/out, velocity out, scores out) */
    float *params, *velocity, *scores;
    /* work buffers (allocated once) */
    float *wt;   /* K x WIDTH x PAD: wt[k][c][j] = W_k[j][c] (row c: what input c adds) */
    float *hwt;  /* ROW x CPAD: hwt[f][c] = hw[c][f'] (f padded position, f' real index) */
    float *hwp;  /* CLASSES x ROW: hw rows in padded positions */
    float *z;    /* batch x ROW: core endpoints */
    float *gs;   /* batch x CPAD: score gradients */
    float *ys;   /* batch: the rows' labels (as floats) */
    float *acts; /* K x batch x PAD: each branch's input activation alpha*relu(x) */
    float *gout; /* K x batch x PAD: each branch's output gradient */
    float *grad; /* nparams: used at the head's offsets (the weights use wg) */
    float *wp;   /* K x WIDTH x WIDTH: weights by column, wp[k][c][j] = W_k[j][c] (trained here) */
    float *wv;   /* K x WIDTH x WIDTH: their velocity, same layout */
    float *wg;   /* K x WIDTH x WIDTH: their gradient, same layout */
    uint64_t *masks;   /* K x batch: per branch and row, the active inputs as bits */
    uint64_t *colbits; /* threads x PAD x words: per thread, column c's active rows as bits */
    int64_t words;     /* 64-bit words for a minibatch's rows */
    /* stopping early */
    const int32_t *cancel; /* the caller's flag (may be NULL) */
    int64_t *progress;     /* the caller's count of minibatches trained (may be NULL) */
    int cancel_seen;       /* thread 0's last reading of it, acted on by all after a barrier */
    int status;            /* 0, CPU_FAST_CANCELLED or CPU_FAST_DIVERGED (written by thread 0) */
    int64_t stop_epoch, stop_step;
} Task;

/* One minibatch: its rows (indices into the training set) and their count. */
typedef struct {
    const int64_t *rows;
    int64_t count;
    float inv_count;
} Batch;

static void *aligned(size_t floats) {
    size_t bytes = ((floats * sizeof(float) + 63) / 64) * 64;
    void *p = aligned_alloc(64, bytes ? bytes : 64);
    if (p)
        memset(p, 0, bytes ? bytes : 64);
    return p;
}

static void free_task(Task *t) {
    free(t->wt);
    free(t->hwt);
    free(t->hwp);
    free(t->z);
    free(t->gs);
    free(t->ys);
    free(t->acts);
    free(t->gout);
    free(t->grad);
    free(t->wp);
    free(t->wv);
    free(t->wg);
    free(t->masks);
    free(t->colbits);
}

static int alloc_task(Task *t) {
    size_t k = (size_t)(2 * t->depth), b = (size_t)t->batch;
    t->wt = aligned(k * WIDTH * PAD);
    t->hwt = aligned(ROW * CPAD);
    t->hwp = aligned(CLASSES * ROW);
    t->z = aligned(b * ROW);
    t->gs = aligned(b * CPAD);
    t->ys = aligned(b);
    t->acts = aligned(k * b * PAD);
    t->gout = aligned(k * b * PAD);
    t->grad = aligned((size_t)t->nparams);
    t->wp = aligned(k * WIDTH * WIDTH);
    t->wv = aligned(k * WIDTH * WIDTH);
    t->wg = aligned(k * WIDTH * WIDTH);
    t->words = (t->batch + 63) / 64;
    t->masks = aligned(2 * k * b); /* (aligned() counts floats: two per 64-bit word) */
    t->colbits = aligned(2 * (size_t)t->threads * PAD * (size_t)t->words);
    return t->wt && t->hwt && t->hwp && t->z && t->gs && t->ys && t->acts && t->gout && t->grad &&
           t->wp && t->wv && t->wg && t->masks && t->colbits;
}

/* ------------------------------------------------------------------------ row pieces */

/* Asks for a training row and its label ahead of use (rows are read in shuffled order). */
INLINE void prefetch_row(const Task *t, int64_t row) {
#if defined(__GNUC__)
    const char *x = (const char *)(t->train_x + (size_t)row * PIXELS);
    for (int off = 0; off < PIXELS * 4 + 64; off += 64)
        __builtin_prefetch(x + off, 0, 2);
    __builtin_prefetch(t->labels + row, 0, 2);
#else
    (void)t;
    (void)row;
#endif
}

/* acc[0..5] += s * w[0..47] */
INLINE void axpy6(vf *acc, float s, const float *w) {
    const vf b = {s, s, s, s, s, s, s, s};
    const vf *wv = (const vf *)w;
    for (int u = 0; u < NV; u++)
        acc[u] += b * wv[u];
}

/* The inputs x[c] of a branch that relu lets through (x > 0, or NaN as in torch), as bit c
 * of a mask. Only these give a nonzero activation (the rare exception, alpha*x underflowing to
 * zero, adds an exact zero) and only these pass a gradient back. Everything that skips the
 * others walks the mask's set bits in ascending order. */
typedef struct {
    uint64_t mask;
} Active;

/* One branch's input activation: a = alpha*relu(x) (x and a are PAD floats with zero
 * padding), and its active inputs. */
INLINE void activate(const float *x, float alpha, float *a, Active *act) {
    uint64_t mask = 0;
#ifdef __AVX2__
    const __m256 al = _mm256_set1_ps(alpha), zero = _mm256_setzero_ps();
    for (int u = 0; u < NV; u++) {
        __m256 xv = _mm256_load_ps(x + 8 * u);
        __m256 keep = _mm256_cmp_ps(xv, zero, _CMP_NLE_UQ); /* x > 0, or NaN */
        _mm256_store_ps(a + 8 * u, _mm256_mul_ps(al, _mm256_and_ps(xv, keep)));
        mask |= (uint64_t)(unsigned)_mm256_movemask_ps(keep) << (8 * u);
    }
#else
    const vf al = {alpha, alpha, alpha, alpha, alpha, alpha, alpha, alpha}, zero = {0};
    /* lane k of vector u is input 8u+k; its flag goes to bit 8*(u%4)+k of word u/4, so two
     * horizontal ORs give the whole 48-bit mask */
    const vi lane_bit = {1, 2, 4, 8, 16, 32, 64, 128};
    vi words[2] = {{0}, {0}};
    for (int u = 0; u < NV; u++) {
        vf xv = ((const vf *)x)[u];
        vi keep = (xv > zero) | (xv != xv);
        ((vf *)a)[u] = al * (vf)((vi)xv & keep);
        words[u / 4] |= (keep & lane_bit) << (8 * (u % 4));
    }
    for (int h = 0; h < 2; h++) {
        vi v = words[h];
        uint32_t m = (uint32_t)(((v[0] | v[1]) | (v[2] | v[3])) | ((v[4] | v[5]) | (v[6] | v[7])));
        mask |= (uint64_t)m << (32 * h);
    }
#endif
    /* padding lanes are zero while training is finite; once it has diverged they may hold
     * NaN (inf * 0): never count them */
    act->mask = mask & ((1ull << WIDTH) - 1);
}

/* out = a @ W.T = sum_c a[c] * wt[c][:] over the active c, in a fixed order. */
INLINE void product(const float *a, const float *wt, const Active *act, vf *out) {
    /* two interleaved partial sums (even and odd positions among the active c): short chains */
    vf e[NV] = {{0}}, o[NV] = {{0}};
    uint64_t m = act->mask;
    while (m != 0) {
        const int c0 = __builtin_ctzll(m);
        m &= m - 1;
        axpy6(e, a[c0], wt + (size_t)c0 * PAD);
        if (m == 0)
            break;
        const int c1 = __builtin_ctzll(m);
        m &= m - 1;
        axpy6(o, a[c1], wt + (size_t)c1 * PAD);
    }
    for (int u = 0; u < NV; u++)
        out[u] = e[u] + o[u];
}

/* One branch: its activation (into `a`, active inputs into *act) and product (into out). */
INLINE void branch_product(const float *x, float alpha, const float *wt, float *a, vf *out, Active *act) {
    activate(x, alpha, a, act);
    product(a, wt, act, out);
}

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define HAVE_SHUFFLE 1
#else
#define HAVE_SHUFFLE 0
#endif

/* Lane k of the result is the sum of the eight lanes of s[k], added as
 * ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7)). */
INLINE vf sum8(const vf *s) {
#if HAVE_SHUFFLE
    vf p[4], q[2];
    for (int k = 0; k < 4; k++)
        p[k] = __builtin_shufflevector(s[2 * k], s[2 * k + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(s[2 * k], s[2 * k + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int k = 0; k < 2; k++)
        q[k] = __builtin_shufflevector(p[2 * k], p[2 * k + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(p[2 * k], p[2 * k + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(q[0], q[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(q[0], q[1], 4, 5, 6, 7, 12, 13, 14, 15);
#else
    float r[8], x[8];
    for (int k = 0; k < 8; k++) {
        memcpy(x, &s[k], sizeof x);
        r[k] = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
    }
    vf out;
    memcpy(&out, r, sizeof out);
    return out;
#endif
}

/* Lanes 0-3 of the result: the sums of the eight lanes of s[0..3], added in sum8's order. */
INLINE vf sum4(const vf *s) {
#if HAVE_SHUFFLE
    vf p0 = __builtin_shufflevector(s[0], s[1], 0, 8, 2, 10, 4, 12, 6, 14) +
            __builtin_shufflevector(s[0], s[1], 1, 9, 3, 11, 5, 13, 7, 15);
    vf p1 = __builtin_shufflevector(s[2], s[3], 0, 8, 2, 10, 4, 12, 6, 14) +
            __builtin_shufflevector(s[2], s[3], 1, 9, 3, 11, 5, 13, 7, 15);
    vf q = __builtin_shufflevector(p0, p1, 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(p0, p1, 2, 3, 10, 11, 6, 7, 14, 15);
    return q + __builtin_shufflevector(q, q, 4, 5, 6, 7, 0, 1, 2, 3);
#else
    vf t[8] = {s[0], s[1], s[2], s[3], s[0], s[1], s[2], s[3]};
    return sum8(t);
#endif
}

/* The sum of the eight lanes of v, added in sum8's order. */
INLINE float sum1(vf v) {
#if HAVE_SHUFFLE
    vf p = v + __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    vf q = p + __builtin_shufflevector(p, p, 2, 3, 0, 1, 6, 7, 4, 5);
    vf r = q + __builtin_shufflevector(q, q, 4, 5, 6, 7, 0, 1, 2, 3);
    return r[0];
#else
    float x[8];
    memcpy(x, &v, sizeof x);
    return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
#endif
}

/* The dot product of g with wt[c] over the padded width, as a vector of partial sums. */
INLINE vf dot_partial(const vf *g, const float *wt, int c) {
    const vf *w = (const vf *)(wt + (size_t)c * PAD);
    vf e = g[0] * w[0], o = g[1] * w[1];
    e += g[2] * w[2];
    o += g[3] * w[3];
    e += g[4] * w[4];
    o += g[5] * w[5];
    return e + o;
}

/* The next N (8 or 4) active c of *m, taken off it: out[c] += alpha * (g @ W)[c]. */
INLINE void grad_group(const vf *g, const float *wt, uint64_t *m, const int N, vf al, float *out) {
    int idx[8];
    vf s[8];
    for (int k = 0; k < N; k++) {
        idx[k] = __builtin_ctzll(*m);
        *m &= *m - 1;
        s[k] = dot_partial(g, wt, idx[k]);
    }
    float r[8];
    vf terms = al * (N == 8 ? sum8(s) : sum4(s));
    memcpy(r, &terms, sizeof r);
    for (int k = 0; k < N; k++)
        out[idx[k]] += r[k];
}

/* The gradient through one branch to its input, added to dst (NV vectors):
 * dst[c] += alpha * (g @ W)[c] for the active c, where (g @ W)[c] = sum_j g[j] W[j][c] is
 * the dot product of g with wt[c] (column c of W); relu gives the other c no gradient, so
 * they are not computed (torch: threshold_backward(alpha * (g @ W), x, 0)). The active c go
 * eight, then four, then one at a time; every dot product ends with the same sum of lanes,
 * so a c's result does not depend on its group. */
INLINE void grad_input(const vf *g, const float *wt, const Active *act, float alpha, vf *dst) {
    const vf al = {alpha, alpha, alpha, alpha, alpha, alpha, alpha, alpha};
    float *out = (float *)dst;
    uint64_t m = act->mask;
    int left = __builtin_popcountll(m);
    for (; left >= 8; left -= 8)
        grad_group(g, wt, &m, 8, al, out);
    if (left >= 4)
        grad_group(g, wt, &m, 4, al, out);
    for (; m != 0; m &= m - 1) {
        const int c = __builtin_ctzll(m);
        out[c] += alpha * sum1(dot_partial(g, wt, c));
    }
}

/* Forward through the core for one lifted row: st (ROW floats, 32-aligned) in place. When
 * `top_a` is given, the last branch's activation goes there and its active inputs and product
 * to *top_act and top_t: the backward's first reconstruction needs exactly these. */
INLINE void core_forward_row(const Task *t, float *st, float *top_a, Active *top_act, vf *top_t) {
    float a[PAD] __attribute__((aligned(32)));
    vf tv[NV];
    Active act;
    vf *l = (vf *)st, *r = (vf *)(st + PAD);
    const int64_t last = t->depth - 1;
    for (int64_t b = 0; b <= last; b++) {
        branch_product(st + PAD, t->alpha, t->wt + (size_t)(2 * b) * WIDTH * PAD, a, tv, &act);
        for (int u = 0; u < NV; u++)
            l[u] = l[u] + tv[u];
        if (b == last)
            break; /* the top block's right branch is below */
        branch_product(st, t->alpha, t->wt + (size_t)(2 * b + 1) * WIDTH * PAD, a, tv, &act);
        for (int u = 0; u < NV; u++)
            r[u] = r[u] + tv[u];
    }
    /* (top_a is a constant wherever this is inlined: NULL for the queries) */
    branch_product(st, t->alpha, t->wt + (size_t)(2 * last + 1) * WIDTH * PAD, top_a ? top_a : a, tv,
                   top_a ? top_act : &act);
    for (int u = 0; u < NV; u++)
        r[u] = r[u] + tv[u];
    if (top_a)
        for (int u = 0; u < NV; u++)
            top_t[u] = tv[u];
}

/* mask ? a : b, lane by lane (mask lanes are all ones or all zeros). */
INLINE vf pick(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* exp(x) for 8 lanes: x = n*ln2 + r with |r| <= ln2/2, exp(r) by a degree-7 Taylor-like
 * polynomial (the classic single-precision minimax coefficients), times 2^n. Relative error
 * about 1e-7 (1-2 ulp) on the softmax range x <= 0; NaN stays NaN; below -87.3 it returns
 * about 1e-38 instead of an underflow (a probability that small changes no sum). */
INLINE vf vexp(vf x) {
    const vf lo = {-87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f};
    const vf hi = {88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f, 88.3f};
    x = pick(x < lo, lo, x); /* NaN compares false and passes through */
    x = pick(x > hi, hi, x);
    const vf log2e = {1.44269504f, 1.44269504f, 1.44269504f, 1.44269504f,
                      1.44269504f, 1.44269504f, 1.44269504f, 1.44269504f};
    const vf magic = {12582912.0f, 12582912.0f, 12582912.0f, 12582912.0f,
                      12582912.0f, 12582912.0f, 12582912.0f, 12582912.0f}; /* 1.5 * 2^23 */
    vf n = (x * log2e + magic) - magic; /* nearest integer to x/ln2 */
    const vf c1 = {0.693359375f, 0.693359375f, 0.693359375f, 0.693359375f,
                   0.693359375f, 0.693359375f, 0.693359375f, 0.693359375f};
    const vf c2 = {-2.12194440e-4f, -2.12194440e-4f, -2.12194440e-4f, -2.12194440e-4f,
                   -2.12194440e-4f, -2.12194440e-4f, -2.12194440e-4f, -2.12194440e-4f};
    vf r = x - n * c1;
    r = r - n * c2;
    const float k[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                        4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
    vf y = {k[0], k[0], k[0], k[0], k[0], k[0], k[0], k[0]};
    for (int q = 1; q < 6; q++)
        y = y * r + (vf){k[q], k[q], k[q], k[q], k[q], k[q], k[q], k[q]};
    const vf one = {1, 1, 1, 1, 1, 1, 1, 1};
    y = y * (r * r) + r + one;
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return y * (vf)bits;
}

/* The sums of the eight lanes of a and of b, into out[0] and out[1]. */
INLINE void sum2(vf a, vf b, float *out) {
#if HAVE_SHUFFLE
    vf p = __builtin_shufflevector(a, b, 0, 8, 1, 9, 2, 10, 3, 11) +
           __builtin_shufflevector(a, b, 4, 12, 5, 13, 6, 14, 7, 15);
    vf q = p + __builtin_shufflevector(p, p, 4, 5, 6, 7, 0, 1, 2, 3);
    vf r = q + __builtin_shufflevector(q, q, 2, 3, 0, 1, 6, 7, 4, 5);
    out[0] = r[0];
    out[1] = r[1];
#else
    float x[8], y[8];
    memcpy(x, &a, sizeof x);
    memcpy(y, &b, sizeof y);
    out[0] = ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]));
    out[1] = ((y[0] + y[4]) + (y[2] + y[6])) + ((y[1] + y[5]) + (y[3] + y[7]));
#endif
}

/* Head scores of one padded endpoint into s[CPAD]: s[c] = sum_f z[f] hw[c][f] + hb[c].
 * Classes 0-7 fill one vector: each feature times its hwt row (four interleaved partial
 * sums over f, added at the end: short dependency chains); classes 8 and 9 are dot products
 * with their hw rows. */
INLINE void head_row(const Task *t, const float *st, const float *hb, float *s) {
    vf lo[4] = {{0}};
    for (int half = 0; half < 2; half++) {
        const float *x = st + half * PAD;
        const vf *w = (const vf *)(t->hwt + (size_t)half * PAD * CPAD);
        for (int c = 0; c < 40; c += 4) {
            for (int u = 0; u < 4; u++) {
                vf b = {x[c + u], x[c + u], x[c + u], x[c + u], x[c + u], x[c + u], x[c + u], x[c + u]};
                lo[u] += b * w[2 * (c + u)];
            }
        }
        vf b = {x[40], x[40], x[40], x[40], x[40], x[40], x[40], x[40]};
        lo[0] += b * w[80];
    }
    vf l = (lo[0] + lo[1]) + (lo[2] + lo[3]);
    vf d[2];
    for (int c = 8; c < CLASSES; c++) {
        const vf *z = (const vf *)st, *w = (const vf *)(t->hwp + (size_t)c * ROW);
        vf e = z[0] * w[0], o = z[1] * w[1];
        for (int u = 2; u < 2 * NV; u += 2) {
            e += z[u] * w[u];
            o += z[u + 1] * w[u + 1];
        }
        d[c - 8] = e + o;
    }
    memcpy(s, &l, sizeof l);
    sum2(d[0], d[1], s + 8);
    for (int c = 0; c < CLASSES; c++)
        s[c] = s[c] + hb[c];
    for (int c = CLASSES; c < CPAD; c++)
        s[c] = 0.0f;
}

/* Lift one raw row (81 pixels) into a padded state: 4*x - 0.5, zero at 81 and in padding. */
INLINE void lift_row(const float *restrict x, float *restrict st) {
    for (int c = 0; c < WIDTH; c++)
        st[c] = x[c] * 4.0f - 0.5f;
    for (int c = WIDTH; c < PAD; c++)
        st[c] = 0.0f;
    for (int c = 0; c < WIDTH - 1; c++)
        st[PAD + c] = x[WIDTH + c] * 4.0f - 0.5f;
    for (int c = WIDTH - 1; c < PAD; c++)
        st[PAD + c] = 0.0f;
}

/* One row of a minibatch: forward, loss gradient, reversible backward. */
/* Row i's active inputs of branch k, for the weight gradients. */
INLINE void note_active(const Task *t, int64_t k, int64_t i, const Active *act) {
    t->masks[(size_t)k * t->batch + i] = act->mask;
}

INLINE void train_row(const Task *t, const Batch *bt, int64_t i) {
    const int64_t K = 2 * t->depth, B = t->batch;
    const float *hb = t->params + K * WIDTH * WIDTH + CLASSES * FEAT;
    float *st = t->z + (size_t)i * ROW;
    const float yf = t->ys[i];
    Active top_act;
    vf top_t[NV] = {{0}};
    core_forward_row(t, st, t->acts + ((size_t)(K - 1) * B + i) * PAD, &top_act, top_t);

    /* gradient of the mean cross-entropy w.r.t. the scores: (softmax(s) - onehot(y)) / count */
    float s[CPAD] __attribute__((aligned(32)));
    head_row(t, st, hb, s);
    /* the max as a tree (short chain); a NaN score makes every probability NaN anyway */
    float m4[5];
    for (int c = 0; c < 5; c++)
        m4[c] = s[2 * c] > s[2 * c + 1] ? s[2 * c] : s[2 * c + 1];
    float m01 = m4[0] > m4[1] ? m4[0] : m4[1], m23 = m4[2] > m4[3] ? m4[2] : m4[3];
    float m03 = m01 > m23 ? m01 : m23;
    float mx = m03 > m4[4] ? m03 : m4[4];
    const vf lanes = {0, 1, 2, 3, 4, 5, 6, 7};
    const vf mxv = {mx, mx, mx, mx, mx, mx, mx, mx};
    vf e[2];
    for (int u = 0; u < 2; u++) {
        e[u] = vexp(((const vf *)s)[u] - mxv);
        e[u] = (vf)((vi)e[u] & (lanes + (float)(8 * u) < (vf){CLASSES, CLASSES, CLASSES, CLASSES, CLASSES,
                                                                    CLASSES, CLASSES, CLASSES}));
    }
    float ev[CPAD] __attribute__((aligned(32)));
    memcpy(ev, e, sizeof ev);
    float sum = 0.0f;
    for (int c = 0; c < CLASSES; c++)
        sum += ev[c];
    float *g = t->gs + (size_t)i * CPAD;
    const float inv = bt->inv_count;
    const vf sumv = {sum, sum, sum, sum, sum, sum, sum, sum}, invv = {inv, inv, inv, inv, inv, inv, inv, inv};
    for (int u = 0; u < 2; u++) {
        vf p = e[u] / sumv;
        vf hit = (vf)((vi)invv & (lanes + (float)(8 * u) == (vf){yf, yf, yf, yf, yf, yf, yf, yf}));
        ((vf *)g)[u] = p * invv - hit;
    }

    /* gradient of the endpoint: gz = gs @ hw */
    vf acc[2 * NV] = {{0}}; /* (accumulated here, in registers, then stored to gz) */
    for (int c = 0; c < CLASSES; c++) {
        float x = g[c];
        vf b = {x, x, x, x, x, x, x, x};
        const vf *w = (const vf *)(t->hwp + (size_t)c * ROW);
        for (int u = 0; u < 2 * NV; u++)
            acc[u] += b * w[u];
    }
    vf gz[2 * NV];
    for (int u = 0; u < 2 * NV; u++)
        gz[u] = acc[u];
    vf *gl = gz, *gr = gz + NV;

    /* reversible backward: rebuild each state from the endpoint by subtraction */
    float state[ROW] __attribute__((aligned(32)));
    for (int u = 0; u < 2 * NV; u++)
        ((vf *)state)[u] = ((const vf *)st)[u];
    vf *l = (vf *)state, *r = (vf *)(state + PAD);
    vf tv[NV];
    Active act;
    for (int64_t b = t->depth - 1; b >= 0; b--) {
        const int64_t kr = 2 * b + 1, kl = 2 * b;
        float *a = t->acts + ((size_t)kr * B + i) * PAD;
        /* right_out = right_in + (alpha*relu(left_out)) @ W_kr.T; in the top block left_out is
         * the endpoint's left half, so the product is the one the forward added (the same
         * inputs give the same bits: recomputing it would change nothing) */
        const Active *ar = &act;
        if (b == t->depth - 1) {
            ar = &top_act;
            for (int u = 0; u < NV; u++)
                tv[u] = top_t[u];
        } else {
            branch_product(state, t->alpha, t->wt + (size_t)kr * WIDTH * PAD, a, tv, &act);
        }
        note_active(t, kr, i, ar);
        for (int u = 0; u < NV; u++)
            r[u] = r[u] - tv[u];
        memcpy(t->gout + ((size_t)kr * B + i) * PAD, gr, PAD * sizeof(float));
        grad_input(gr, t->wt + (size_t)kr * WIDTH * PAD, ar, t->alpha, gl);
        /* left_out = left_in + (alpha*relu(right_in)) @ W_kl.T */
        a = t->acts + ((size_t)kl * B + i) * PAD;
        if (b > 0) {
            branch_product(state + PAD, t->alpha, t->wt + (size_t)kl * WIDTH * PAD, a, tv, &act);
            for (int u = 0; u < NV; u++)
                l[u] = l[u] - tv[u];
        } else {
            /* the lifted input itself is never needed: only this branch's activation */
            activate(state + PAD, t->alpha, a, &act);
        }
        note_active(t, kl, i, &act);
        memcpy(t->gout + ((size_t)kl * B + i) * PAD, gl, PAD * sizeof(float));
        if (b > 0)
            grad_input(gl, t->wt + (size_t)kl * WIDTH * PAD, &act, t->alpha, gr);
    }
}

/* Transposes a 64 x 64 bit matrix in place: afterwards bit i of a[c] is what bit c of a[i]
 * was (swapping ever smaller blocks: 32 x 32, then 16 x 16, ...). */
INLINE void transpose64(uint64_t a[64]) {
    uint64_t m = 0x00000000FFFFFFFFull;
    for (int j = 32; j != 0; j >>= 1, m ^= m << j)
        for (int k = 0; k < 64; k = ((k | j) + 1) & ~j) {
            uint64_t x = ((a[k] >> j) ^ a[k | j]) & m;
            a[k] ^= x << j;
            a[k | j] ^= x;
        }
}

/* Weight gradient columns [c0, c1) of branch k: wg[k][c][j] = sum_i acts[i][c] * gout[i][j]
 * (= dL/dW_k[j][c]), summed in order of i over the rows whose input c was active (the others
 * have a zero activation, an exact zero term). The rows' masks, transposed 64 rows at a time,
 * give each column's rows as bits. */
INLINE void weight_grad_columns(const Task *t, int tid, int64_t n, int64_t k, int64_t c0, int64_t c1) {
    const int64_t B = t->batch, W = (n + 63) / 64;
    const float *A = t->acts + (size_t)k * B * PAD, *G = t->gout + (size_t)k * B * PAD;
    uint64_t *bits = t->colbits + (size_t)tid * PAD * t->words; /* bits[c * words + w] */
    for (int64_t w = 0; w < W; w++) {
        uint64_t block[64];
        const int64_t rows = n - 64 * w < 64 ? n - 64 * w : 64;
        memcpy(block, t->masks + (size_t)k * B + 64 * w, (size_t)rows * sizeof(uint64_t));
        memset(block + rows, 0, (size_t)(64 - rows) * sizeof(uint64_t));
        transpose64(block);
        for (int64_t c = c0; c < c1; c++)
            bits[c * t->words + w] = block[c];
    }
    float tmp[PAD] __attribute__((aligned(32)));
    for (int64_t c = c0; c < c1; c++) {
        vf acc[NV] = {{0}};
        for (int64_t w = 0; w < W; w++)
            for (uint64_t x = bits[c * t->words + w]; x != 0; x &= x - 1) {
                const size_t i = (size_t)(64 * w + __builtin_ctzll(x));
                axpy6(acc, A[i * PAD + c], G + i * PAD);
            }
        for (int u = 0; u < NV; u++)
            ((vf *)tmp)[u] = acc[u];
        memcpy(t->wg + ((size_t)k * WIDTH + c) * WIDTH, tmp, WIDTH * sizeof(float));
    }
}

/* Head gradient for class c: ghw[c][:] = sum_i gs[i][c] z[i][:], ghb[c] = sum_i gs[i][c]
 * (in order of i). */
INLINE void head_grad_class(const Task *t, int64_t n, int c) {
    const int64_t K = 2 * t->depth;
    float *ghw = t->grad + K * WIDTH * WIDTH + (size_t)c * FEAT;
    float bias = 0.0f;
    for (int64_t i = 0; i < n; i++)
        bias += t->gs[(size_t)i * CPAD + c];
    /* one half of the features at a time: six accumulators stay in registers (twelve did not) */
    for (int half = 0; half < 2; half++) {
        float part[PAD] __attribute__((aligned(32)));
        vf p[NV] = {{0}};
        for (int64_t i = 0; i < n; i++) {
            float x = t->gs[(size_t)i * CPAD + c];
            vf b = {x, x, x, x, x, x, x, x};
            const vf *zr = (const vf *)(t->z + (size_t)i * ROW + half * PAD);
            for (int u = 0; u < NV; u++)
                p[u] += b * zr[u];
        }
        for (int u = 0; u < NV; u++)
            ((vf *)part)[u] = p[u];
        memcpy(ghw + half * WIDTH, part, WIDTH * sizeof(float));
    }
    t->grad[K * WIDTH * WIDTH + CLASSES * FEAT + c] = bias;
}

/* SGD with momentum over params[i0, i1), in torch.optim.SGD's order of operations:
 * v = v*momentum rounded on its own (torch: v.mul_(momentum)), then v + g where
 * g = g + wd*p when wd != 0 (torch: g.add(p, alpha=wd)), then p = p + (-lr)*v (torch:
 * p.add_(v, alpha=-lr)). The first pass stores v*momentum so it is never fused with + g. */
INLINE void sgd_range(const Task *t, float *p, float *v, const float *g, int64_t i0, int64_t i1) {
    const float mom = t->momentum, neg_lr = -t->lr, wd = t->wd;
    for (int64_t i = i0; i < i1; i++)
        v[i] = v[i] * mom;
    if (wd != 0.0f) {
        for (int64_t i = i0; i < i1; i++) {
            float vi = v[i] + (g[i] + p[i] * wd);
            v[i] = vi;
            p[i] = p[i] + vi * neg_lr;
        }
    } else {
        for (int64_t i = i0; i < i1; i++) {
            float vi = v[i] + g[i];
            v[i] = vi;
            p[i] = p[i] + vi * neg_lr;
        }
    }
}

/* Padded working copies of columns [c0, c1) of weight k: rows of wt. */
INLINE void refresh_weight_columns(Task *t, int64_t k, int64_t c0, int64_t c1) {
    const float *w = t->wp + (size_t)k * WIDTH * WIDTH;
    float *wt = t->wt + (size_t)k * WIDTH * PAD;
    for (int64_t c = c0; c < c1; c++)
        for (int j = 0; j < WIDTH; j++) {
            wt[(size_t)c * PAD + j] = w[(size_t)c * WIDTH + j];
        }
}

/* Padded working copies of head class c: the hwt column and the hwp row. */
INLINE void refresh_head_class(Task *t, int c) {
    const float *hw = t->params + 2 * t->depth * WIDTH * WIDTH;
    for (int f = 0; f < FEAT; f++) {
        int fp = f < WIDTH ? f : PAD + (f - WIDTH);
        t->hwt[(size_t)fp * CPAD + c] = hw[(size_t)c * FEAT + f];
        t->hwp[(size_t)c * ROW + fp] = hw[(size_t)c * FEAT + f];
    }
}

/* The update phase for units [lo, hi): unit k*WIDTH + c is column c of weight k, unit
 * K*WIDTH + c is head class c (its hw row and hb entry). Each unit's gradient, SGD step and
 * working copies depend on that unit alone, so units split freely over threads. */
INLINE void update_units(Task *t, int64_t n, int tid, int64_t lo, int64_t hi) {
    const int64_t K = 2 * t->depth;
    for (int64_t k = 0; k < K; k++) {
        int64_t a = lo > k * WIDTH ? lo - k * WIDTH : 0;
        int64_t b = hi - k * WIDTH < WIDTH ? hi - k * WIDTH : WIDTH;
        if (a < b) {
            weight_grad_columns(t, tid, n, k, a, b);
            sgd_range(t, t->wp, t->wv, t->wg, k * WIDTH * WIDTH + a * WIDTH, k * WIDTH * WIDTH + b * WIDTH);
            refresh_weight_columns(t, k, a, b);
        }
    }
    for (int c = 0; c < CLASSES; c++) {
        int64_t u = K * WIDTH + c;
        if (u >= lo && u < hi) {
            head_grad_class(t, n, c);
            int64_t hw0 = K * WIDTH * WIDTH + (int64_t)c * FEAT, hb = K * WIDTH * WIDTH + CLASSES * FEAT + c;
            sgd_range(t, t->params, t->velocity, t->grad, hw0, hw0 + FEAT);
            sgd_range(t, t->params, t->velocity, t->grad, hb, hb + 1);
            refresh_head_class(t, c);
        }
    }
}

/* ------------------------------------------------------------------------ threads */

typedef struct {
    atomic_int arrived;
    atomic_int generation;
    int parties;
} Barrier;

static void barrier_wait(Barrier *b) {
    int gen = atomic_load_explicit(&b->generation, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) + 1 == b->parties) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&b->generation, 1, memory_order_acq_rel);
        return;
    }
    /* spin briefly, then yield the core: never burn a core another thread needs */
    for (int spins = 0; atomic_load_explicit(&b->generation, memory_order_acquire) == gen; spins++) {
        if (spins > 2000)
            sched_yield();
    }
}

typedef struct {
    Task *task;
    Barrier *barrier;
    int id, parties;
} Worker;

static void split(int64_t total, int id, int parties, int64_t *lo, int64_t *hi) {
    *lo = total * id / parties;
    *hi = total * (id + 1) / parties;
}

/* Has the caller asked the run to stop? Thread 0 reads the flag (relaxed: no ordering is
 * needed, only that a write from another thread is seen soon) in every minibatch's update
 * phase and before the first minibatch; every thread acts on that reading, t->cancel_seen,
 * after the next barrier, and thread 0 writes it again only after the barrier that follows. */
INLINE int cancel_requested(const Task *t) {
    return t->cancel != NULL && __atomic_load_n(t->cancel, __ATOMIC_RELAXED) != 0;
}

/* The caller may watch how far the run is (a relaxed store: a count, no ordering needed). */
INLINE void report_progress(Task *t, int64_t done) {
    if (t->progress != NULL)
        __atomic_store_n(t->progress, done, __ATOMIC_RELAXED);
}

/* Is the head bias still finite after a minibatch's update? A non-finite score anywhere in
 * the minibatch (NaN, or +inf: inf - inf in the softmax) makes that row's whole score gradient
 * NaN, and the bias gradient sums those rows. Every thread reads the same ten values after the
 * update's barrier (nobody writes them before the next one), so all decide alike. A weight
 * that overflowed without any score doing so yet shows at a later minibatch, or in the
 * caller's check of all parameters after the run. */
INLINE int head_bias_finite(const Task *t) {
    const float *hb = t->params + 2 * t->depth * WIDTH * WIDTH + CLASSES * FEAT;
    int finite = 1;
    for (int c = 0; c < CLASSES; c++)
        finite &= isfinite(hb[c]) != 0;
    return finite;
}

/* Where and why the run stopped early (every thread calls it; thread 0 records it). */
INLINE void stop_run(Task *t, int id, int status, int64_t epoch, int64_t step) {
    if (id == 0) {
        t->status = status;
        t->stop_epoch = epoch;
        t->stop_step = step;
    }
}

/* The whole task, as seen by worker `id` of `parties` (phases end at a barrier). */
INLINE void run_worker(Worker *w) {
    Task *t = w->task;
    const int id = w->id, P = w->parties;
    const int64_t K = 2 * t->depth;
    int64_t lo, hi;

    /* working copies of the initial parameters */
    const int64_t units = K * WIDTH + CLASSES;
    int64_t ulo, uhi;
    split(units, id, P, &ulo, &uhi);
    for (int64_t k = 0; k < K; k++) {
        int64_t a = ulo > k * WIDTH ? ulo - k * WIDTH : 0;
        int64_t b = uhi - k * WIDTH < WIDTH ? uhi - k * WIDTH : WIDTH;
        for (int64_t c = a; c < b; c++) /* columns of the initial weights, zero velocity */
            for (int j = 0; j < WIDTH; j++) {
                t->wp[((size_t)k * WIDTH + c) * WIDTH + j] = t->params[((size_t)k * WIDTH + j) * WIDTH + c];
                t->wv[((size_t)k * WIDTH + c) * WIDTH + j] = 0.0f;
            }
        if (a < b)
            refresh_weight_columns(t, k, a, b);
    }
    for (int c = 0; c < CLASSES; c++)
        if (K * WIDTH + c >= ulo && K * WIDTH + c < uhi)
            refresh_head_class(t, c);
    if (id == 0)
        t->cancel_seen = cancel_requested(t);
    barrier_wait(w->barrier);

    int64_t done = 0; /* minibatches trained (counted by thread 0) */
    for (int64_t e = 0; e < t->epochs; e++) {
        for (int64_t start = 0, step = 0; start < t->n; start += t->batch, step++) {
            if (t->cancel_seen) {
                stop_run(t, id, CPU_FAST_CANCELLED, e, step);
                return;
            }
            Batch bt = {.rows = t->perms + e * t->n + start,
                        .count = t->n - start < t->batch ? t->n - start : t->batch};
            bt.inv_count = 1.0f / (float)bt.count;
            /* rows: forward, loss gradient, reversible backward */
            split(bt.count, id, P, &lo, &hi);
            /* the rows are read in shuffled order: lift them (and fetch their labels) all
             * first, so that cache misses overlap instead of each stalling a row's long chain
             * of work; while training on them, ask for the next minibatch's rows */
            for (int64_t i = lo; i < hi; i++) {
                lift_row(t->train_x + (size_t)bt.rows[i] * PIXELS, t->z + (size_t)i * ROW);
                t->ys[i] = (float)t->labels[bt.rows[i]];
            }
            const int64_t next = start + t->batch < t->n ? e * t->n + start + t->batch
                                 : e + 1 < t->epochs ? (e + 1) * t->n : -1;
            for (int64_t i = lo; i < hi; i++) {
                if (next >= 0 && next + i < t->epochs * t->n)
                    prefetch_row(t, t->perms[next + i]);
                train_row(t, &bt, i);
            }
            barrier_wait(w->barrier);
            /* weight gradients, SGD and working copies, unit by unit */
            update_units(t, bt.count, id, ulo, uhi);
            if (id == 0) {
                t->cancel_seen = cancel_requested(t);
                report_progress(t, ++done);
            }
            barrier_wait(w->barrier);
            if (!head_bias_finite(t)) {
                stop_run(t, id, CPU_FAST_DIVERGED, e, step);
                return;
            }
        }
    }
    if (t->cancel_seen) {
        stop_run(t, id, CPU_FAST_CANCELLED, t->epochs, 0);
        return;
    }
    /* final weights and velocity back in torch's layout, W_k[j][c] */
    for (int64_t k = 0; k < K; k++) {
        int64_t a = ulo > k * WIDTH ? ulo - k * WIDTH : 0;
        int64_t b = uhi - k * WIDTH < WIDTH ? uhi - k * WIDTH : WIDTH;
        for (int64_t c = a; c < b; c++)
            for (int j = 0; j < WIDTH; j++) {
                t->params[((size_t)k * WIDTH + j) * WIDTH + c] = t->wp[((size_t)k * WIDTH + c) * WIDTH + j];
                t->velocity[((size_t)k * WIDTH + j) * WIDTH + c] = t->wv[((size_t)k * WIDTH + c) * WIDTH + j];
            }
    }

    /* score the queries with the final parameters (plain forward) */
    const float *hb = t->params + K * WIDTH * WIDTH + CLASSES * FEAT;
    split(t->m, id, P, &lo, &hi);
    float st[ROW] __attribute__((aligned(32)));
    for (int64_t r = lo; r < hi; r++) {
        lift_row(t->test_x + (size_t)r * PIXELS, st);
        core_forward_row(t, st, NULL, NULL, NULL);
        float s[CPAD] __attribute__((aligned(32)));
        head_row(t, st, hb, s);
        memcpy(t->scores + (size_t)r * CLASSES, s, CLASSES * sizeof(float));
    }
}

/* the one place the whole kernel is inlined */
static __attribute__((noinline)) void run_worker_entry(Worker *w) { run_worker(w); }


typedef struct {
    Worker worker;
    atomic_int *gate; /* 0: wait, 1: run, 2: give up */
} Start;

static void *thread_main(void *arg) {
    Start *s = arg;
    int gate;
    while ((gate = atomic_load_explicit(s->gate, memory_order_acquire)) == 0)
        sched_yield();
    if (gate == 1)
        run_worker_entry(&s->worker);
    return NULL;
}

/* Runs the task on t->threads threads (this one included). Returns 0, CPU_FAST_CANCELLED or
 * CPU_FAST_DIVERGED, or the pthread error when a worker thread could not be started (then
 * nothing has run). */
static int run_task(Task *t) {
    int parties = t->threads;
    Barrier barrier = {.parties = parties};
    atomic_init(&barrier.arrived, 0);
    atomic_init(&barrier.generation, 0);
    atomic_int gate;
    atomic_init(&gate, 0);
    Start starts[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    for (int i = 0; i < parties; i++)
        starts[i] = (Start){.worker = {.task = t, .barrier = &barrier, .id = i, .parties = parties}, .gate = &gate};
    int started = 1, rc = 0;
    for (; started < parties; started++) {
        rc = pthread_create(&ids[started], NULL, thread_main, &starts[started]);
        if (rc != 0)
            break;
    }
    atomic_store_explicit(&gate, rc == 0 ? 1 : 2, memory_order_release);
    if (rc == 0)
        run_worker_entry(&starts[0].worker);
    for (int i = 1; i < started; i++)
        pthread_join(ids[i], NULL);
    return rc != 0 ? rc : t->status;
}

/* ------------------------------------------------------------------------ entry point */

int KERNEL_ENTRY(const KernelArgs *args) {
    Task t = {0};
    t.n = args->n;
    t.m = args->m;
    t.epochs = args->epochs;
    t.batch = args->batch < args->n ? args->batch : args->n;
    t.depth = args->depth;
    t.nparams = 2 * args->depth * WIDTH * WIDTH + CLASSES * FEAT + CLASSES;
    t.alpha = args->alpha;
    t.lr = args->lr;
    t.momentum = args->momentum;
    t.wd = args->wd;
    t.threads = args->threads < 1 ? 1 : (args->threads > MAX_THREADS ? MAX_THREADS : args->threads);
    t.train_x = args->train_x;
    t.labels = args->labels;
    t.perms = args->perms;
    t.test_x = args->test_x;
    t.params = args->params;
    t.velocity = args->velocity;
    t.scores = args->scores;
    t.cancel = args->cancel;
    t.progress = args->progress;
    t.stop_epoch = t.epochs;
    if (!alloc_task(&t)) {
        free_task(&t);
        return ENOMEM;
    }
    memset(t.velocity, 0, (size_t)t.nparams * sizeof(float));
    int rc = run_task(&t);
    if (args->stop_at) {
        args->stop_at[0] = t.stop_epoch;
        args->stop_at[1] = t.stop_step;
    }
    free_task(&t);
    return rc;
}
