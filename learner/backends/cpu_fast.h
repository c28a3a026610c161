/*
 * The cpu-fast kernel's entry points, shared by the Python glue (cpu_fast_kernel.c) and the
 * kernel's compiled variants (cpu_fast_generic.c, cpu_fast_x86_64_v3.c), which all include
 * the same code, cpu_fast_train.h.
 */
#ifndef REV88_CPU_FAST_H
#define REV88_CPU_FAST_H

#include <stdint.h>

/* The task's fixed sizes, shared by the glue and the kernel. */
#define PIXELS 81  /* a 9x9 image */
#define WIDTH 41   /* a half state */
#define FEAT 82    /* the head's input: both halves */
#define CLASSES 10
#define MAX_THREADS 64

/* One task: sizes, config, inputs and outputs (params in/out, velocity and scores out). The
 * glue has checked every size, label and permutation entry before a kernel sees them. */
typedef struct {
    int64_t n, m, epochs, batch, depth;
    float alpha, lr, momentum, wd;
    int threads;
    const float *train_x, *test_x;
    const int64_t *labels, *perms;
    float *params, *velocity, *scores;
    const int32_t *cancel; /* NULL, or the caller's flag: nonzero asks the run to stop */
    int64_t *progress;     /* NULL, or out: minibatches trained so far, updated as the run goes */
    int64_t *stop_at;      /* out, 2 items: [epoch, step] where the run stopped (epochs, 0 when done) */
} KernelArgs;

/* A run that stopped early (negative, so never an errno value); stop_at says where. */
#define CPU_FAST_CANCELLED (-1) /* *cancel was nonzero before minibatch stop_at (epochs, 0: before scoring) */
#define CPU_FAST_DIVERGED (-2)  /* minibatch stop_at left the head bias non-finite */

/* Each returns 0, CPU_FAST_CANCELLED or CPU_FAST_DIVERGED, ENOMEM when its buffers could not be
 * allocated, or the pthread error when a worker thread could not be started (then nothing has
 * run). */
int cpu_fast_train_generic(const KernelArgs *args);

/* The AVX2 + FMA variant exists where GCC can compile it beside the generic one. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define CPU_FAST_HAVE_V3 1
int cpu_fast_train_x86_64_v3(const KernelArgs *args);
#else
#define CPU_FAST_HAVE_V3 0
#endif

#endif
