/* Two host-side passes over a KeyedJaggedTensor, called through ctypes (GIL released) by
 * recsys_core.sparse._native_lib; the module object exists only so that the package's build can
 * compile this file as an (optional) extension. Without it the same work runs as torch ops.
 *
 * recsys_key_sums_*: one pass over the lengths for recsys_core.sparse._safety: each key's sum,
 * and whether every length lies in [0, max_length] (read as unsigned, a negative length is
 * larger than any bound). They return 0 when every length is proven in range (sums[k] then
 * holds key k's sum of its `stride` lengths), else 1: the caller then runs the exact checks,
 * which name a bad entry or, if there is none, compute the sums again.
 *
 * recsys_permute_blocks: KeyedJaggedTensor.permute's copies (see its comment below).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

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

/* KeyedJaggedTensor.permute on the host. A KJT is key-major, so a permute is a gather of one
 * contiguous block per output key from each of lengths, values and (optionally) weights. torch.cat
 * of per-key slices costs a dispatch and a thread-pool hand-off per slice (on 26 keys more than
 * the copy itself); here it is one memcpy per block on the caller's thread.
 *
 * meta (int64), built by recsys_core.sparse._native_lib.permute_blocks:
 *   [0] K keys  [1] N output keys
 *   [2 + 4t .. 5 + 4t] for t = 0 lengths, 1 values, 2 weights: source address, destination
 *                      address, bytes per row, rows in the source (weights absent: all 0)
 *   [14 .. 14+N)       order: the source key of each output key
 *   [14+N .. 14+N+K)   rows of each key in lengths (the stride per key)
 *   then K entries     rows of each key in values and weights (the length per key)
 * Returns 0 after copying, or 1 without writing anything when an index or a block lies outside
 * its source (the caller proved the KJT safe before, so that is a bug the torch path reports)
 * or there are more than PERMUTE_MAX_KEYS keys (the torch path runs). */
#define PERMUTE_HEADER 14
#define PERMUTE_MAX_KEYS 4096

int64_t recsys_permute_blocks(const int64_t *meta) {
    const int64_t K = meta[0], N = meta[1];
    const int64_t *order = meta + PERMUTE_HEADER;
    int64_t start[PERMUTE_MAX_KEYS + 1];
    if (K < 0 || K > PERMUTE_MAX_KEYS || N < 0) return 1;
    for (int64_t j = 0; j < N; j++)
        if (order[j] < 0 || order[j] >= K) return 1;
    for (int t = 0; t < 3; t++) { /* every block inside its source, before any write */
        const int64_t *rows = order + N + (t == 0 ? 0 : K);
        if (t == 2 && meta[2 + 4 * t] == 0) continue; /* no weights */
        int64_t total = 0;
        for (int64_t k = 0; k < K; k++) {
            if (rows[k] < 0 || rows[k] > meta[5 + 4 * t] - total) return 1;
            total += rows[k];
        }
        if (meta[4 + 4 * t] < 0) return 1;
    }
    for (int t = 0; t < 3; t++) {
        const char *src = (const char *)(intptr_t)meta[2 + 4 * t];
        char *dst = (char *)(intptr_t)meta[3 + 4 * t];
        const int64_t row_bytes = meta[4 + 4 * t];
        const int64_t *rows = order + N + (t == 0 ? 0 : K);
        if (src == NULL) continue; /* no weights, or an empty tensor (no rows to copy) */
        start[0] = 0;
        for (int64_t k = 0; k < K; k++) start[k + 1] = start[k] + rows[k];
        for (int64_t j = 0; j < N; j++) {
            const int64_t bytes = rows[order[j]] * row_bytes;
            if (bytes > 0) memcpy(dst, src + start[order[j]] * row_bytes, (size_t)bytes);
            dst += bytes;
        }
    }
    return 0;
}

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "_native",
    "KJT host passes (per-key sums and range check, permute copies), called through ctypes",
    -1, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&native_module); }
