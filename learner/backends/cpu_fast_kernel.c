/*
 * The cpu-fast kernel's Python module, learner.backends._cpu_fast: argument checks, the choice
 * of compiled variant for the CPU at hand, and the call. The kernel itself (the math, buffers,
 * threads) is cpu_fast_train.h, compiled twice: cpu_fast_generic.c for any CPU and, with GCC
 * on x86-64, cpu_fast_x86_64_v3.c for AVX2 + FMA, the variant picked whenever the CPU has it.
 * The two differ in the last bits (FMA contraction); each is repeatable on its own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "cpu_fast.h"

typedef int (*Kernel)(const KernelArgs *);

/* Does this CPU have what the x86-64-v3 variant was compiled for? */
static int cpu_has_v3(void) {
#if CPU_FAST_HAVE_V3
    __builtin_cpu_init();
    return __builtin_cpu_supports("x86-64-v3");
#else
    return 0;
#endif
}

/* The variant for `name` ("auto", "generic" or "x86-64-v3"), or NULL with an exception. */
static Kernel pick_kernel(const char *name, const char **picked) {
    if (strcmp(name, "auto") == 0)
        name = cpu_has_v3() ? "x86-64-v3" : "generic";
    *picked = name;
    if (strcmp(name, "generic") == 0)
        return cpu_fast_train_generic;
#if CPU_FAST_HAVE_V3
    if (strcmp(name, "x86-64-v3") == 0) {
        if (!cpu_has_v3()) {
            PyErr_SetString(PyExc_ValueError, "this CPU lacks x86-64-v3 (AVX2, FMA): use isa='generic'");
            return NULL;
        }
        return cpu_fast_train_x86_64_v3;
    }
#endif
    PyErr_Format(PyExc_ValueError, "isa must be 'auto', 'generic'%s, got '%s'",
                 CPU_FAST_HAVE_V3 ? " or 'x86-64-v3'" : "", name);
    return NULL;
}

/* Buffer kinds: 'f' float32, 'q' int64, 'i' int32. */
static const char *kind_name(char kind) { return kind == 'f' ? "float32" : kind == 'q' ? "int64" : "int32"; }

static int format_matches(const char *fmt, Py_ssize_t itemsize, char kind) {
    if (*fmt == '<' || *fmt == '=' || *fmt == '@')
        fmt++;
    if (kind == 'f')
        return strcmp(fmt, "f") == 0 && itemsize == 4;
    int integer = strcmp(fmt, "i") == 0 || strcmp(fmt, "l") == 0 || strcmp(fmt, "q") == 0;
    return integer && itemsize == (kind == 'q' ? 8 : 4);
}

/* A C-contiguous buffer of `count` items of `kind`. */
static int get_buffer(PyObject *obj, Py_buffer *view, int writable, char kind, Py_ssize_t count, const char *name) {
    Py_ssize_t itemsize = kind == 'q' ? 8 : 4;
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) != 0) {
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous%s buffer", name, writable ? " writable" : "");
        return -1;
    }
    if (!format_matches(view->format ? view->format : "B", view->itemsize, kind)) {
        PyErr_Format(PyExc_ValueError, "%s must be %s, got buffer format '%s'", name, kind_name(kind),
                     view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    if (view->len != itemsize * count) {
        PyErr_Format(PyExc_ValueError, "%s must hold %zd items, got %zd", name, count, view->len / itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *py_train_predict(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *otx, *olab, *operm, *otest, *oparams, *ovel, *oscores, *ocancel = Py_None, *oprogress = Py_None;
    long long n, m, epochs, batch, depth;
    float alpha, lr, momentum, wd;
    int threads;
    const char *isa = "auto", *picked = NULL;
    if (!PyArg_ParseTuple(args, "OOOOOOOLLLLLffffi|sOO", &otx, &olab, &operm, &otest, &oparams, &ovel, &oscores,
                          &n, &m, &epochs, &batch, &depth, &alpha, &lr, &momentum, &wd, &threads, &isa, &ocancel,
                          &oprogress))
        return NULL;
    if (n < 1 || m < 1 || epochs < 1 || batch < 1 || depth < 1 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "n, m, epochs, batch, depth and threads must be >= 1");
        return NULL;
    }
    Kernel kernel = pick_kernel(isa, &picked);
    if (kernel == NULL)
        return NULL;
    const Py_ssize_t nparams = 2 * depth * WIDTH * WIDTH + CLASSES * FEAT + CLASSES;
    int64_t stop_at[2] = {epochs, 0};
    KernelArgs a = {.n = n, .m = m, .epochs = epochs, .batch = batch, .depth = depth, .alpha = alpha,
                    .lr = lr, .momentum = momentum, .wd = wd, .threads = threads < MAX_THREADS ? threads : MAX_THREADS,
                    .stop_at = stop_at};

    Py_buffer b[9];
    int got = 0;
    PyObject *result = NULL;
    if (get_buffer(otx, &b[got], 0, 'f', n * PIXELS, "train_x") < 0)
        goto done;
    got++;
    if (get_buffer(olab, &b[got], 0, 'q', n, "labels") < 0)
        goto done;
    got++;
    if (get_buffer(operm, &b[got], 0, 'q', epochs * n, "permutations") < 0)
        goto done;
    got++;
    if (get_buffer(otest, &b[got], 0, 'f', m * PIXELS, "test_x") < 0)
        goto done;
    got++;
    if (get_buffer(oparams, &b[got], 1, 'f', nparams, "params") < 0)
        goto done;
    got++;
    if (get_buffer(ovel, &b[got], 1, 'f', nparams, "velocity") < 0)
        goto done;
    got++;
    if (get_buffer(oscores, &b[got], 1, 'f', m * CLASSES, "scores") < 0)
        goto done;
    got++;
    if (ocancel != Py_None) { /* held (so kept alive) while the kernel reads it */
        if (get_buffer(ocancel, &b[got], 0, 'i', 1, "cancel") < 0)
            goto done;
        a.cancel = b[got].buf;
        got++;
    }
    if (oprogress != Py_None) {
        if (get_buffer(oprogress, &b[got], 1, 'q', 1, "progress") < 0)
            goto done;
        a.progress = b[got].buf;
        got++;
    }
    a.train_x = b[0].buf;
    a.labels = b[1].buf;
    a.perms = b[2].buf;
    a.test_x = b[3].buf;
    a.params = b[4].buf;
    a.velocity = b[5].buf;
    a.scores = b[6].buf;
    for (int64_t i = 0; i < n; i++)
        if (a.labels[i] < 0 || a.labels[i] >= CLASSES) {
            PyErr_Format(PyExc_ValueError, "labels[%lld] = %lld is not a class in 0..9", (long long)i,
                         (long long)a.labels[i]);
            goto done;
        }
    for (int64_t i = 0; i < epochs * n; i++)
        if (a.perms[i] < 0 || a.perms[i] >= n) {
            PyErr_Format(PyExc_ValueError, "permutation entry %lld = %lld is outside 0..%lld", (long long)i,
                         (long long)a.perms[i], (long long)(n - 1));
            goto done;
        }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kernel(&a);
    Py_END_ALLOW_THREADS
    if (rc == ENOMEM) {
        PyErr_NoMemory();
        goto done;
    }
    const char *outcome = rc == 0                    ? "completed"
                          : rc == CPU_FAST_CANCELLED ? "cancelled"
                          : rc == CPU_FAST_DIVERGED  ? "diverged"
                                                     : NULL;
    if (outcome == NULL) {
        PyErr_Format(PyExc_OSError, "could not start %d kernel threads (error %d)", a.threads, rc);
        goto done;
    }
    result = Py_BuildValue("(ssLL)", picked, outcome, (long long)stop_at[0], (long long)stop_at[1]);
done:
    for (int i = 0; i < got; i++)
        PyBuffer_Release(&b[i]);
    return result;
}

static PyObject *py_isa(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyUnicode_FromString(cpu_has_v3() ? "x86-64-v3" : "generic");
}

static PyObject *py_variants(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    if (cpu_has_v3())
        return Py_BuildValue("(ss)", "generic", "x86-64-v3");
    return Py_BuildValue("(s)", "generic");
}

static PyMethodDef methods[] = {
    {"train_predict", py_train_predict, METH_VARARGS,
     "train_predict(train_x, labels, permutations, test_x, params, velocity, scores, n, m, epochs, "
     "batch, depth, alpha, lr, momentum, weight_decay, threads, isa='auto', cancel=None, progress=None) -> "
     "(isa, outcome, epoch, step). Trains params in place from their initial values, writes the final "
     "velocity and the query scores. isa: the compiled variant that ran ('generic' or 'x86-64-v3'; "
     "'auto' picks the best this CPU runs). cancel: None or an int32 buffer of one item, read once "
     "per minibatch while the GIL is released; nonzero stops the run. progress: None or a writable int64 "
     "buffer of one item, set to the number of minibatches trained as the run goes. outcome: 'completed' (epoch = "
     "epochs, step = 0), 'cancelled' (stopped before minibatch `step` of `epoch`; epoch = epochs: "
     "before scoring) or 'diverged' (minibatch `step` of `epoch` left the head bias non-finite); "
     "the outputs of a run that stopped early are incomplete."},
    {"isa", py_isa, METH_NOARGS, "The compiled variant 'auto' picks on this CPU."},
    {"variants", py_variants, METH_NOARGS, "The compiled variants this CPU can run."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_fast", "The cpu-fast training kernel.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__cpu_fast(void) { return PyModule_Create(&module); }
