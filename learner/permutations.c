/* Epoch permutations of many seeds in one call, without the GIL (learner/permutations.py).
 *
 * A task's epoch e trains in the order of the e-th permutation drawn from one numpy
 * Generator(PCG64(seed)) (learner/train.py). numpy makes a permutation of n as arange(n) shuffled
 * in place: Fisher-Yates from the last element down, element i swapped with element
 * random_interval(i), its uniform integer in [0, i] drawn by masking 32-bit draws (64-bit ones past
 * 2**32) and rejecting those above i. Each such call of numpy's lets go of the GIL and takes it
 * back; a sweep's first launch needs 132 seeds' states, and in a busy service every take-back
 * waits behind the other threads' Python. This draws them all in one call, with the same
 * algorithm over numpy's own generators: the draws come from each bit generator's C interface
 * (its ``capsule``, numpy's documented bitgen_t), so the numbers are numpy's.
 *
 *   permute(bit_generators, outs) -> None
 *
 * ``bit_generators``: numpy BitGenerator objects (PCG64), each used by this call alone;
 * ``outs``: as many writable C-contiguous int64 buffers, each filled with a permutation of its
 * length drawn from its generator, as ``Generator(bg).permutation(len(out))`` would draw it. A
 * generator left in the state numpy's would be in, so the next call gives the next epoch's.
 * learner/permutations.py checks this against numpy before it uses it, and uses numpy if they
 * differ. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* numpy's bitgen_t (numpy/random/bitgen.h), the C interface every BitGenerator exposes */
typedef struct {
    void *state;
    uint64_t (*next_uint64)(void *st);
    uint32_t (*next_uint32)(void *st);
    double (*next_double)(void *st);
    uint64_t (*next_raw)(void *st);
} bitgen_t;

/* numpy's random_interval: a uniform integer in [0, max] */
static uint64_t random_interval(bitgen_t *g, uint64_t max) {
    if (max == 0) return 0;
    uint64_t mask = max, value;
    mask |= mask >> 1;
    mask |= mask >> 2;
    mask |= mask >> 4;
    mask |= mask >> 8;
    mask |= mask >> 16;
    mask |= mask >> 32;
    if (max <= 0xffffffffULL) {
        while ((value = (g->next_uint32(g->state) & mask)) > max)
            ;
    } else {
        while ((value = (g->next_uint64(g->state) & mask)) > max)
            ;
    }
    return value;
}

static void permutation(bitgen_t *g, int64_t *a, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) a[i] = i;
    for (Py_ssize_t i = n - 1; i >= 1; i--) {
        Py_ssize_t j = (Py_ssize_t)random_interval(g, (uint64_t)i);
        int64_t t = a[i];
        a[i] = a[j];
        a[j] = t;
    }
}

/* a buffer of native int64s: format "l" or "q", "@", "=" or (on a little-endian machine) "<" before it */
static int is_int64(const Py_buffer *v) {
    const uint16_t one = 1;
    const char *f = v->format;
    if (v->itemsize != 8 || f == NULL) return 0;
    if (*f == '@' || *f == '=' || (*f == '<' && *(const uint8_t *)&one == 1)) f++;
    return (f[0] == 'l' || f[0] == 'q') && f[1] == '\0';
}

static PyObject *permute(PyObject *self, PyObject *args) {
    PyObject *gens_in, *outs_in;
    if (!PyArg_ParseTuple(args, "OO", &gens_in, &outs_in)) return NULL;
    PyObject *gens = PySequence_Fast(gens_in, "bit_generators must be a sequence");
    if (gens == NULL) return NULL;
    PyObject *outs = PySequence_Fast(outs_in, "outs must be a sequence");
    if (outs == NULL) {
        Py_DECREF(gens);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(gens);
    Py_buffer *views = NULL;
    bitgen_t **bitgens = NULL;
    PyObject **capsules = NULL;
    Py_ssize_t held = 0, caps = 0;
    PyObject *result = NULL;
    if (PySequence_Fast_GET_SIZE(outs) != count) {
        PyErr_Format(PyExc_ValueError, "%zd bit generators but %zd outputs", count, PySequence_Fast_GET_SIZE(outs));
        goto done;
    }
    views = PyMem_Calloc((size_t)(count ? count : 1), sizeof(Py_buffer));
    bitgens = PyMem_Calloc((size_t)(count ? count : 1), sizeof(bitgen_t *));
    capsules = PyMem_Calloc((size_t)(count ? count : 1), sizeof(PyObject *));
    if (views == NULL || bitgens == NULL || capsules == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        capsules[i] = PyObject_GetAttrString(PySequence_Fast_GET_ITEM(gens, i), "capsule");
        if (capsules[i] == NULL) goto done;
        caps++;
        bitgens[i] = PyCapsule_GetPointer(capsules[i], "BitGenerator");
        if (bitgens[i] == NULL) goto done;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(outs, i), &views[i],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            goto done;
        held++;
        if (!is_int64(&views[i])) {
            PyErr_Format(PyExc_ValueError, "output %zd is not a native int64 buffer (format %s)", i,
                         views[i].format ? views[i].format : "?");
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) permutation(bitgens[i], (int64_t *)views[i].buf, views[i].len / 8);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    for (Py_ssize_t k = 0; k < held; k++) PyBuffer_Release(&views[k]);
    for (Py_ssize_t k = 0; k < caps; k++) Py_DECREF(capsules[k]);
    PyMem_Free(views);
    PyMem_Free(bitgens);
    PyMem_Free(capsules);
    Py_DECREF(gens);
    Py_DECREF(outs);
    return result;
}

static PyMethodDef methods[] = {
    {"permute", permute, METH_VARARGS,
     "permute(bit_generators, outs) -> None: each int64 buffer in outs filled with a permutation of its length, "
     "drawn from its numpy bit generator as Generator(bg).permutation(n) draws it"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_permutations",
                                    "numpy's permutations of many seeds in one call, without the GIL", -1, methods};

PyMODINIT_FUNC PyInit__permutations(void) { return PyModule_Create(&module); }
