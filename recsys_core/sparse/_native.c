/* One pass over a KeyedJaggedTensor's lengths for recsys_core.sparse._safety: each key's sum,
 * and whether every length lies in [0, max_length] (read as unsigned, a negative length is
 * larger than any bound). Loaded through ctypes (GIL released); the module object exists only
 * so that the package's build can compile this file as an (optional) extension. Without it the
 * same proof runs as two numpy/torch passes.
 *
 * Both functions return 0 when every length is proven in range (sums[k] then holds key k's sum
 * of its `stride` lengths), else 1: the caller then runs the exact checks, which name a bad
 * entry or, if there is none, compute the sums again.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

/* On x86-64 with GCC or Clang, one copy per vector width, picked when the library loads. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__APPLE__)
#define RECSYS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define RECSYS_CLONES
#endif

/* The range proof is a bitwise OR of all the lengths (it vectorizes on any x86-64, where an
 * unsigned 64-bit compare does not): a negative length sets the sign bit, and every length is
 * at most the OR. So OR <= max_length proves them all in range; above it (a negative length,
 * or in range but with bits that OR past the bound) the caller takes the exact checks. */
RECSYS_CLONES int64_t recsys_key_sums_i64(const int64_t *lengths, int64_t num_keys, int64_t stride,
                            int64_t max_length, int64_t *sums) {
    uint64_t acc = 0;
    for (int64_t k = 0; k < num_keys; k++) {
        const int64_t *p = lengths + k * stride;
        int64_t s = 0;
        for (int64_t i = 0; i < stride; i++) {
            s += p[i];
            acc |= (uint64_t)p[i];
        }
        sums[k] = s;
    }
    return (max_length >= 0 && acc <= (uint64_t)max_length) ? 0 : 1;
}

RECSYS_CLONES int64_t recsys_key_sums_i32(const int32_t *lengths, int64_t num_keys, int64_t stride,
                            int64_t max_length, int64_t *sums) {
    uint32_t acc = 0;
    for (int64_t k = 0; k < num_keys; k++) {
        const int32_t *p = lengths + k * stride;
        int64_t s = 0;
        for (int64_t i = 0; i < stride; i++) {
            s += p[i];
            acc |= (uint32_t)p[i];
        }
        sums[k] = s;
    }
    if (acc & 0x80000000u) return 1; /* a negative length */
    return (max_length >= 0 && (int64_t)acc <= max_length) ? 0 : 1;
}

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "_native",
    "one-pass per-key sums and range check of KJT lengths, called through ctypes",
    -1, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&native_module); }
