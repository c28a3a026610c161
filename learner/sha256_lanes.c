/* SHA-256 (FIPS 180-4) of many buffers at once, sixteen side by side.
 *
 * A launch's answers carry fifteen SHA-256s of its outputs per task: its scores (400 KB for
 * 10,000 queries), its predictions, each final parameter and velocity array, the state vector. One
 * buffer at a time, SHA-NI does ~1.6 GB/s on the VM this was written on (docs/performance.md);
 * the rounds of one buffer depend on each other, so a core's vector units sit idle. Sixteen
 * independent buffers fill the sixteen 32-bit lanes of an AVX-512 register instead: each lane
 * runs the same rounds on its own buffer, its own padding and length.
 *
 *   digests(items, generic=False) -> list[str]
 *
 * ``items``: each a buffer (C-contiguous bytes: bytes, a numpy array, a memoryview) or a list or
 * tuple of buffers hashed as their concatenation (a state vector from its parameters, without
 * the copy). Returns each item's hex digest, in order, the same text as hashlib's hexdigest().
 * The hashing runs without the GIL. ``generic=True``: the same lanes in plain C (the scheduling
 * and padding tested on any machine; slower than hashlib, so never chosen for speed).
 * ``has_avx512()``: whether this CPU runs the AVX-512 rounds (AVX-512F and BW).
 *
 * The lanes are refilled one by one: when a lane's buffer is done (its last padded block
 * compressed), its digest is written and it takes the next item, so buffers of any lengths share
 * the rounds with little idle; a lane with nothing left is fed a block of zeros and ignored. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_AVX512_KERNEL 1
#include <immintrin.h>
#endif

#define LANES 16

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};
static const uint32_t H0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                               0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

/* ------------------------------------------------------------------ the rounds, 16 lanes */

/* state[j][l]: word j of lane l's chaining value; block[l]: 64 bytes of lane l's message */
typedef void (*compress_fn)(uint32_t state[8][LANES], const uint8_t *const block[LANES]);

static inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static inline uint32_t load_be32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

static void compress_generic(uint32_t state[8][LANES], const uint8_t *const block[LANES]) {
    for (int l = 0; l < LANES; l++) {
        uint32_t w[64];
        for (int t = 0; t < 16; t++) w[t] = load_be32(block[l] + 4 * t);
        for (int t = 16; t < 64; t++) {
            uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        uint32_t a = state[0][l], b = state[1][l], c = state[2][l], d = state[3][l];
        uint32_t e = state[4][l], f = state[5][l], g = state[6][l], h = state[7][l];
        for (int t = 0; t < 64; t++) {
            uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + K[t] + w[t];
            uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
        }
        state[0][l] += a; state[1][l] += b; state[2][l] += c; state[3][l] += d;
        state[4][l] += e; state[5][l] += f; state[6][l] += g; state[7][l] += h;
    }
}

#ifdef HAVE_AVX512_KERNEL
#define AVX512 __attribute__((target("avx512f,avx512bw")))
/* vpternlogd's truth tables: the three-way xor, e ? f : g (Ch), the majority (Maj) */
#define XOR3 0x96
#define CHOOSE 0xCA
#define MAJORITY 0xE8

AVX512 static void compress_avx512(uint32_t state[8][LANES], const uint8_t *const block[LANES]) {
    /* lane l's block is row l of a 16 x 16 matrix of words; transposed, register t holds word t
       of every lane (interleave 32-bit, then 64-bit, then 128-bit quarters), each word's bytes
       then read big-endian */
    __m512i r[16], u[16], w[16];
    for (int l = 0; l < LANES; l++) r[l] = _mm512_loadu_si512((const void *)block[l]);
    for (int i = 0; i < 8; i++) {
        u[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        u[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  /* u -> r: r[4 i + j] holds word 4 k + j of rows 4 i .. 4 i + 3 in quarter k */
        r[4 * i] = _mm512_unpacklo_epi64(u[4 * i], u[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(u[4 * i], u[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(u[4 * i + 1], u[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(u[4 * i + 1], u[4 * i + 3]);
    }
    const __m512i swap = _mm512_broadcast_i32x4(_mm_setr_epi8(3, 2, 1, 0, 7, 6, 5, 4, 11, 10, 9, 8, 15, 14, 13, 12));
    for (int j = 0; j < 4; j++) {
        __m512i x0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), x1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
        __m512i y0 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44), y1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
        w[j] = _mm512_shuffle_epi8(_mm512_shuffle_i32x4(x0, y0, 0x88), swap);
        w[4 + j] = _mm512_shuffle_epi8(_mm512_shuffle_i32x4(x0, y0, 0xDD), swap);
        w[8 + j] = _mm512_shuffle_epi8(_mm512_shuffle_i32x4(x1, y1, 0x88), swap);
        w[12 + j] = _mm512_shuffle_epi8(_mm512_shuffle_i32x4(x1, y1, 0xDD), swap);
    }

    __m512i a = _mm512_load_si512((const void *)state[0]), b = _mm512_load_si512((const void *)state[1]);
    __m512i c = _mm512_load_si512((const void *)state[2]), d = _mm512_load_si512((const void *)state[3]);
    __m512i e = _mm512_load_si512((const void *)state[4]), f = _mm512_load_si512((const void *)state[5]);
    __m512i g = _mm512_load_si512((const void *)state[6]), h = _mm512_load_si512((const void *)state[7]);
#pragma GCC unroll 64
    for (int t = 0; t < 64; t++) {
        __m512i wt;
        if (t < 16) {
            wt = w[t];
        } else {  /* the schedule, in a ring of sixteen */
            __m512i x = w[(t - 15) & 15], y = w[(t - 2) & 15];
            __m512i s0 = _mm512_ternarylogic_epi32(_mm512_ror_epi32(x, 7), _mm512_ror_epi32(x, 18),
                                                   _mm512_srli_epi32(x, 3), XOR3);
            __m512i s1 = _mm512_ternarylogic_epi32(_mm512_ror_epi32(y, 17), _mm512_ror_epi32(y, 19),
                                                   _mm512_srli_epi32(y, 10), XOR3);
            wt = _mm512_add_epi32(_mm512_add_epi32(w[t & 15], s0), _mm512_add_epi32(w[(t - 7) & 15], s1));
            w[t & 15] = wt;
        }
        __m512i sum1 = _mm512_ternarylogic_epi32(_mm512_ror_epi32(e, 6), _mm512_ror_epi32(e, 11),
                                                 _mm512_ror_epi32(e, 25), XOR3);
        __m512i t1 = _mm512_add_epi32(_mm512_add_epi32(h, sum1),
                                      _mm512_add_epi32(_mm512_ternarylogic_epi32(e, f, g, CHOOSE),
                                                       _mm512_add_epi32(_mm512_set1_epi32((int)K[t]), wt)));
        __m512i sum0 = _mm512_ternarylogic_epi32(_mm512_ror_epi32(a, 2), _mm512_ror_epi32(a, 13),
                                                 _mm512_ror_epi32(a, 22), XOR3);
        __m512i t2 = _mm512_add_epi32(sum0, _mm512_ternarylogic_epi32(a, b, c, MAJORITY));
        h = g; g = f; f = e; e = _mm512_add_epi32(d, t1);
        d = c; c = b; b = a; a = _mm512_add_epi32(t1, t2);
    }
    __m512i out[8] = {a, b, c, d, e, f, g, h};
    for (int j = 0; j < 8; j++)
        _mm512_store_si512((void *)state[j], _mm512_add_epi32(_mm512_load_si512((const void *)state[j]), out[j]));
}

static int avx512_cpu = -1;  /* asked once, when the module is loaded */

static int has_avx512_cpu(void) {
    if (avx512_cpu < 0) {
        __builtin_cpu_init();
        avx512_cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    }
    return avx512_cpu;
}
#else
static int has_avx512_cpu(void) { return 0; }
#endif

/* ------------------------------------------------------------------ the lanes' feed */

typedef struct {
    const uint8_t *p;
    Py_ssize_t n;
} chunk_t;

typedef struct {
    Py_ssize_t first, count;  /* its chunks: chunks[first .. first + count) */
    uint64_t total;           /* bytes */
} item_t;

typedef struct {
    Py_ssize_t item;   /* -1: idle */
    Py_ssize_t chunk;  /* cursor: index into chunks, and the offset in it */
    Py_ssize_t off;
    uint64_t done;     /* message bytes consumed */
    int tail_blocks, tail_next;  /* the padded tail: 1 or 2 blocks, built in stage once reached */
    uint8_t stage[128];
} lane_t;

/* n bytes from the lane's cursor into dst, across chunk boundaries */
static void take(lane_t *L, const chunk_t *chunks, const item_t *it, uint8_t *dst, Py_ssize_t n) {
    while (n > 0) {
        const chunk_t *c = &chunks[L->chunk];
        Py_ssize_t here = c->n - L->off;
        if (here == 0) {
            L->chunk++;
            L->off = 0;
            continue;
        }
        if (here > n) here = n;
        memcpy(dst, c->p + L->off, (size_t)here);
        dst += here;
        n -= here;
        L->off += here;
    }
    (void)it;
}

static const uint8_t *next_block(lane_t *L, const chunk_t *chunks, const item_t *it) {
    if (L->tail_blocks == 0 && L->done + 64 <= it->total) {
        while (chunks[L->chunk].n - L->off == 0) {  /* (an empty chunk, or the end of one) */
            L->chunk++;
            L->off = 0;
        }
        const chunk_t *c = &chunks[L->chunk];
        L->done += 64;
        if (c->n - L->off >= 64) {  /* read in place */
            const uint8_t *p = c->p + L->off;
            L->off += 64;
            return p;
        }
        take(L, chunks, it, L->stage, 64);  /* a block across two chunks */
        return L->stage;
    }
    if (L->tail_blocks == 0) {  /* the rest (< 64 bytes), 0x80, zeros, the length in bits */
        Py_ssize_t rest = (Py_ssize_t)(it->total - L->done);
        take(L, chunks, it, L->stage, rest);
        memset(L->stage + rest, 0, sizeof L->stage - (size_t)rest);
        L->stage[rest] = 0x80;
        L->tail_blocks = rest < 56 ? 1 : 2;
        uint64_t bits = it->total * 8;
        uint8_t *end = L->stage + 64 * L->tail_blocks - 8;
        for (int i = 0; i < 8; i++) end[i] = (uint8_t)(bits >> (56 - 8 * i));
        L->tail_next = 0;
    }
    return L->stage + 64 * L->tail_next++;
}

static void start(lane_t *L, uint32_t state[8][LANES], int l, Py_ssize_t item, const item_t *items) {
    L->item = item;
    L->chunk = items[item].first;
    L->off = 0;
    L->done = 0;
    L->tail_blocks = 0;
    L->tail_next = 0;
    for (int j = 0; j < 8; j++) state[j][l] = H0[j];
}

static void hash_items(const chunk_t *chunks, const item_t *items, Py_ssize_t count, uint8_t *out,
                       compress_fn compress) {
    static const uint8_t zeros[64] = {0};
    uint32_t state[8][LANES] __attribute__((aligned(64)));
    lane_t lanes[LANES];
    const uint8_t *block[LANES];
    Py_ssize_t next = 0;
    int active = 0;
    for (int l = 0; l < LANES; l++) {
        if (next < count) {
            start(&lanes[l], state, l, next++, items);
            active++;
        } else {
            lanes[l].item = -1;
            for (int j = 0; j < 8; j++) state[j][l] = 0;
        }
    }
    while (active > 0) {
        for (int l = 0; l < LANES; l++)
            block[l] = lanes[l].item < 0 ? zeros : next_block(&lanes[l], chunks, &items[lanes[l].item]);
        compress(state, block);
        for (int l = 0; l < LANES; l++) {
            lane_t *L = &lanes[l];
            if (L->item < 0 || L->tail_blocks == 0 || L->tail_next < L->tail_blocks) continue;
            uint8_t *digest = out + 32 * L->item;
            for (int j = 0; j < 8; j++) {
                uint32_t v = state[j][l];
                digest[4 * j] = (uint8_t)(v >> 24);
                digest[4 * j + 1] = (uint8_t)(v >> 16);
                digest[4 * j + 2] = (uint8_t)(v >> 8);
                digest[4 * j + 3] = (uint8_t)v;
            }
            if (next < count) {
                start(L, state, l, next++, items);
            } else {
                L->item = -1;
                active--;
            }
        }
    }
}

/* ------------------------------------------------------------------ Python */

static PyObject *digests(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"items", "generic", NULL};
    PyObject *seq_in;
    int generic = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|p", names, &seq_in, &generic)) return NULL;
    compress_fn compress = compress_generic;
#ifdef HAVE_AVX512_KERNEL
    if (!generic) {
        if (!has_avx512_cpu()) {
            PyErr_SetString(PyExc_RuntimeError, "this CPU has no AVX-512 (F and BW): use generic=True or hashlib");
            return NULL;
        }
        compress = compress_avx512;
    }
#else
    if (!generic) {
        PyErr_SetString(PyExc_RuntimeError, "built without the AVX-512 rounds: use generic=True or hashlib");
        return NULL;
    }
#endif
    PyObject *seq = PySequence_Fast(seq_in, "items must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t nchunks = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        nchunks += (PyList_Check(item) || PyTuple_Check(item)) ? PySequence_Fast_GET_SIZE(item) : 1;
    }
    Py_buffer *views = PyMem_Calloc((size_t)(nchunks ? nchunks : 1), sizeof(Py_buffer));
    chunk_t *chunks = PyMem_Calloc((size_t)(nchunks + 1), sizeof(chunk_t));
    item_t *items = PyMem_Calloc((size_t)(count ? count : 1), sizeof(item_t));
    uint8_t *out = PyMem_Malloc((size_t)(32 * (count ? count : 1)));
    PyObject *result = NULL;
    Py_ssize_t held = 0;
    if (views == NULL || chunks == NULL || items == NULL || out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        int many = PyList_Check(item) || PyTuple_Check(item);
        Py_ssize_t parts = many ? PySequence_Fast_GET_SIZE(item) : 1;
        items[i].first = held;
        items[i].count = parts;
        items[i].total = 0;
        for (Py_ssize_t k = 0; k < parts; k++) {
            PyObject *part = many ? PySequence_Fast_GET_ITEM(item, k) : item;
            if (PyObject_GetBuffer(part, &views[held], PyBUF_C_CONTIGUOUS) < 0) goto done;
            chunks[held].p = views[held].buf;
            chunks[held].n = views[held].len;
            items[i].total += (uint64_t)views[held].len;
            held++;
        }
    }
    chunks[held].p = NULL;  /* (a sentinel: never read past an item's bytes) */
    chunks[held].n = 0;
    Py_BEGIN_ALLOW_THREADS
    hash_items(chunks, items, count, out, compress);
    Py_END_ALLOW_THREADS
    result = PyList_New(count);
    if (result == NULL) goto done;
    static const char hex[] = "0123456789abcdef";
    for (Py_ssize_t i = 0; i < count; i++) {
        char text[64];
        for (int k = 0; k < 32; k++) {
            text[2 * k] = hex[out[32 * i + k] >> 4];
            text[2 * k + 1] = hex[out[32 * i + k] & 15];
        }
        PyObject *s = PyUnicode_FromStringAndSize(text, 64);
        if (s == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, s);
    }
done:
    for (Py_ssize_t k = 0; k < held; k++) PyBuffer_Release(&views[k]);
    PyMem_Free(views);
    PyMem_Free(chunks);
    PyMem_Free(items);
    PyMem_Free(out);
    Py_DECREF(seq);
    return result;
}

static PyObject *has_avx512(PyObject *self, PyObject *unused) {
#ifdef HAVE_AVX512_KERNEL
    return PyBool_FromLong(has_avx512_cpu());
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"digests", (PyCFunction)(void (*)(void))digests, METH_VARARGS | METH_KEYWORDS,
     "digests(items, generic=False) -> list of SHA-256 hex digests (an item: a buffer, or a list of buffers hashed "
     "as their concatenation)"},
    {"has_avx512", has_avx512, METH_NOARGS, "whether this CPU runs the AVX-512 rounds"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sha256_lanes",
                                    "SHA-256 of many buffers, sixteen side by side", -1, methods};

PyMODINIT_FUNC PyInit__sha256_lanes(void) {
    has_avx512_cpu();
    return PyModule_Create(&module);
}
