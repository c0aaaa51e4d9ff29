/* Host-side passes over a KeyedJaggedTensor (and the column-run copy of pooled embeddings),
 * called through ctypes (GIL released) by recsys_core.sparse._native_lib; the module object
 * exists only so that the package's build can compile this file as an (optional) extension.
 * Without it the same work runs as torch ops.
 *
 * recsys_key_sums_*: one pass over the lengths for recsys_core.sparse._safety: each key's sum,
 * and whether every length lies in [0, max_length] (read as unsigned, a negative length is
 * larger than any bound). They return 0 when every length is proven in range (sums[k] then
 * holds key k's sum of its `stride` lengths), else 1: the caller then runs the exact checks,
 * which name a bad entry or, if there is none, compute the sums again.
 *
 * recsys_offsets_diff_*: the lengths of a KJT given only offsets.
 * recsys_permute_blocks: KeyedJaggedTensor.permute's copies (see its comment below).
 * recsys_copy_column_runs: recsys_core.kernels.packed's column-run copies (see below).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

/* On x86-64 with GCC or Clang, the plain loops below get one copy per vector width, picked when
 * the library loads (the compiler vectorizes each for its target). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__APPLE__)
#define RECSYS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define RECSYS_X86_DISPATCH 1
#else
#define RECSYS_CLONES
#define RECSYS_X86_DISPATCH 0
#endif

/* The loops written with vectors (GCC/Clang vector extensions) come in builds of one macro per
 * register width, picked once by the CPU: 64-byte vectors compiled for AVX-512, 32-byte ones for
 * AVX2, 16-byte ones for every other CPU (SSE2 on x86-64, NEON on arm64). One width for all
 * would not do: the compiler lowers a vector wider than the target's registers through memory.
 * The 64-byte loops these replaced ran 7x slower in an AVX2 build (65 vs 9 us for 26 x 4096
 * lengths), 32-byte ones 3x slower in a baseline x86-64 build. */
#if defined(__GNUC__) || defined(__clang__)
#define RECSYS_VECTORS 1
typedef int64_t recsys_v8i64 __attribute__((vector_size(64)));
typedef uint64_t recsys_v8u64 __attribute__((vector_size(64)));
typedef int64_t recsys_v4i64 __attribute__((vector_size(32)));
typedef uint64_t recsys_v4u64 __attribute__((vector_size(32)));
typedef int64_t recsys_v2i64 __attribute__((vector_size(16)));
typedef uint64_t recsys_v2u64 __attribute__((vector_size(16)));
typedef char recsys_v32c __attribute__((vector_size(32)));
/* lanes 1.. of `lo` then lane 0 of `hi`: the block one entry after `lo` */
#if defined(__clang__)
#define RECSYS_SHIFT1_8(lo, hi) __builtin_shufflevector(lo, hi, 1, 2, 3, 4, 5, 6, 7, 8)
#define RECSYS_SHIFT1_4(lo, hi) __builtin_shufflevector(lo, hi, 1, 2, 3, 4)
#define RECSYS_SHIFT1_2(lo, hi) __builtin_shufflevector(lo, hi, 1, 2)
#else
#define RECSYS_SHIFT1_8(lo, hi) __builtin_shuffle(lo, hi, (recsys_v8u64){1, 2, 3, 4, 5, 6, 7, 8})
#define RECSYS_SHIFT1_4(lo, hi) __builtin_shuffle(lo, hi, (recsys_v4u64){1, 2, 3, 4})
#define RECSYS_SHIFT1_2(lo, hi) __builtin_shuffle(lo, hi, (recsys_v2u64){1, 2})
#endif
#else
#define RECSYS_VECTORS 0
#endif

#if RECSYS_X86_DISPATCH
#define RECSYS_AVX512 __attribute__((target("avx512f")))
#define RECSYS_AVX2 __attribute__((target("avx2")))
/* 2 with AVX-512F, 1 with AVX2, else 0 */
static int recsys_cpu_vector_level(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
}
/* the builds in use: the CPU's, or a lower one a test asked for (py_vector_level) */
static int recsys_level = -1; /* racing first calls store the same value */
static int recsys_vector_level(void) {
    if (recsys_level < 0) recsys_level = recsys_cpu_vector_level();
    return recsys_level;
}
#define RECSYS_PICK(name)                                                                        \
    (recsys_vector_level() == 2 ? name##_512 : recsys_vector_level() == 1 ? name##_256 : name##_128)
#else
#define RECSYS_PICK(name) name##_128
#endif

/* The range proof is a bitwise OR of all the lengths (it vectorizes on any x86-64, where an
 * unsigned 64-bit compare does not): a negative length sets the sign bit, and every length is
 * at most the OR. So OR <= max_length proves them all in range; above it (a negative length,
 * or in range but with bits that OR past the bound) the caller takes the exact checks.
 *
 * int64 lengths (the common case) go through four independent sum/OR chains of vectors: a
 * single scalar chain, as compiled from a plain loop, is bound by the add's latency (5.8 us for
 * 26 x 4096 lengths in cache on an AVX-512 EPYC), four by the loads (4.0 us). V is the vector
 * type, W its lanes. */
#define RECSYS_KEY_SUMS_I64_VEC(NAME, ATTR, V, W)                                                \
    ATTR static int64_t NAME(const int64_t *lengths, int64_t num_keys, int64_t stride,          \
                             int64_t max_length, int64_t *sums) {                                \
        V or0 = {0}, or1 = {0}, or2 = {0}, or3 = {0};                                            \
        uint64_t acc = 0;                                                                        \
        for (int64_t k = 0; k < num_keys; k++) {                                                 \
            const int64_t *p = lengths + k * stride;                                             \
            V s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, a, b, c, d;                                \
            int64_t i = 0;                                                                       \
            for (; i + 4 * W <= stride; i += 4 * W) {                                            \
                memcpy(&a, p + i, sizeof a); /* unaligned loads */                               \
                memcpy(&b, p + i + W, sizeof b);                                                 \
                memcpy(&c, p + i + 2 * W, sizeof c);                                             \
                memcpy(&d, p + i + 3 * W, sizeof d);                                             \
                s0 += a; s1 += b; s2 += c; s3 += d;                                              \
                or0 |= a; or1 |= b; or2 |= c; or3 |= d;                                          \
            }                                                                                    \
            s0 += s1 + s2 + s3;                                                                  \
            int64_t total = 0;                                                                   \
            for (int j = 0; j < W; j++) total += s0[j];                                          \
            for (; i < stride; i++) {                                                            \
                total += p[i];                                                                   \
                acc |= (uint64_t)p[i];                                                           \
            }                                                                                    \
            sums[k] = total;                                                                     \
        }                                                                                        \
        or0 |= or1 | or2 | or3;                                                                  \
        for (int j = 0; j < W; j++) acc |= (uint64_t)or0[j];                                     \
        return (max_length >= 0 && acc <= (uint64_t)max_length) ? 0 : 1;                        \
    }

#if RECSYS_VECTORS
#if RECSYS_X86_DISPATCH
RECSYS_KEY_SUMS_I64_VEC(recsys_key_sums_i64_512, RECSYS_AVX512, recsys_v8i64, 8)
RECSYS_KEY_SUMS_I64_VEC(recsys_key_sums_i64_256, RECSYS_AVX2, recsys_v4i64, 4)
#endif
RECSYS_KEY_SUMS_I64_VEC(recsys_key_sums_i64_128, , recsys_v2i64, 2)

int64_t recsys_key_sums_i64(const int64_t *lengths, int64_t num_keys, int64_t stride,
                            int64_t max_length, int64_t *sums) {
    return RECSYS_PICK(recsys_key_sums_i64)(lengths, num_keys, stride, max_length, sums);
}
#else
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
#endif

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

/* recsys_key_sums_offsets_{i64,i32}: a KJT given BOTH lengths and offsets (as TorchRec users and
 * pipelines build them). One pass over the n = num_keys * stride lengths and n + 1 offsets proves
 * - every length in [0, max_length] (the OR of the lengths, as in recsys_key_sums_*),
 * - offsets[0] == 0 and offsets[j + 1] - offsets[j] == lengths[j] for every j (the OR of
 *   (difference XOR length) stays 0),
 * - every offset >= 0 (the OR of the offsets has no sign bit).
 * By induction the offsets are then the exact running sums of the lengths: offsets[j + 1] is
 * offsets[j] + lengths[j] modulo 2^bits, and a true sum past the type's largest value would
 * show as a negative offset. So each key's sum is the difference of its two bounding offsets
 * and the pass keeps no sums of its own. Returns 0 when all of it holds, else 1 (the caller's
 * exact checks then name the problem).
 *
 * recsys_key_sums_from_offsets_{i64,i32}: a KJT given only offsets. The pass proves
 * offsets[0] == 0, every offset >= 0 (so no difference overflows), that they never decrease
 * (every implied length >= 0) and that the last is at most max_length, so every implied length
 * lies in [0, max_length] without materializing the lengths; the sums are again differences.
 *
 * Both read offsets[j] and offsets[j + 1]. Their int64 vector loops load each block of offsets
 * once and shift it by one lane against the next block (one shuffle) instead of loading the
 * same data again one entry later: that second load straddled two cache lines every time.
 * 26 x 4096 int64 lengths and offsets (1.7 MB, out of L3) on an AVX-512 EPYC: 22 -> 17 us,
 * the bandwidth of the read; offsets only 14 -> 10.5 us. */
#define RECSYS_SUMS_FROM_BOUNDS                                                                  \
    for (int64_t k = 0; k < num_keys; k++)                                                       \
        sums[k] = (int64_t)offsets[(k + 1) * stride] - (int64_t)offsets[k * stride];

#define RECSYS_SUMS_WITH_OFFSETS(NAME, T, UT)                                                    \
    RECSYS_CLONES int64_t NAME(const T *lengths, const T *offsets, int64_t num_keys,             \
                               int64_t stride, int64_t max_length, int64_t *sums) {              \
        const int64_t n = num_keys * stride;                                                     \
        UT acc = 0, mismatch = (UT)offsets[0], negative = (UT)offsets[n];                        \
        for (int64_t j = 0; j < n; j++) {                                                        \
            acc |= (UT)lengths[j];                                                               \
            negative |= (UT)offsets[j];                                                          \
            mismatch |= ((UT)offsets[j + 1] - (UT)offsets[j]) ^ (UT)lengths[j];                  \
        }                                                                                        \
        if (mismatch != 0 || max_length < 0 || ((acc | negative) >> (sizeof(UT) * 8 - 1)))      \
            return 1;                                                                            \
        if ((int64_t)acc > max_length) return 1;                                                 \
        RECSYS_SUMS_FROM_BOUNDS                                                                  \
        return 0;                                                                                \
    }
#define RECSYS_SUMS_FROM_OFFSETS(NAME, T, UT)                                                    \
    RECSYS_CLONES int64_t NAME(const T *offsets, int64_t num_keys, int64_t stride,               \
                               int64_t max_length, int64_t *sums) {                              \
        const int64_t n = num_keys * stride;                                                     \
        /* every offset >= 0 (so no difference overflows) and no difference < 0 */              \
        UT negative = (UT)offsets[n];                                                            \
        for (int64_t j = 0; j < n; j++)                                                          \
            negative |= (UT)offsets[j] | ((UT)offsets[j + 1] - (UT)offsets[j]);                  \
        if (offsets[0] != 0 || (negative >> (sizeof(UT) * 8 - 1)) || max_length < 0) return 1;  \
        if ((int64_t)offsets[n] > max_length) return 1;                                          \
        RECSYS_SUMS_FROM_BOUNDS                                                                  \
        return 0;                                                                                \
    }

/* The int64 vector loops (unsigned lanes: the differences wrap, as the proof expects, instead
 * of overflowing). Two blocks of W per step; each step also loads the offsets block at
 * j + 2W (the next step's first), so it runs while j + 3W <= n + 1 (the offsets' size); a
 * scalar tail does the rest. */
#define RECSYS_SUMS_WITH_OFFSETS_I64_VEC(NAME, ATTR, V, W, SHIFT1)                               \
    ATTR static int64_t NAME(const int64_t *lengths, const int64_t *offsets, int64_t num_keys,  \
                             int64_t stride, int64_t max_length, int64_t *sums) {                \
        const int64_t n = num_keys * stride;                                                     \
        V or0 = {0}, or1 = {0}, neg0 = {0}, neg1 = {0}, mm0 = {0}, mm1 = {0};                    \
        V a, b, lo, mid, hi;                                                                     \
        uint64_t acc = 0, negative = (uint64_t)offsets[n], mismatch = (uint64_t)offsets[0];      \
        int64_t j = 0;                                                                           \
        if (n + 1 >= 3 * W) {                                                                    \
            memcpy(&lo, offsets, sizeof lo);                                                     \
            for (; j + 3 * W <= n + 1; j += 2 * W) {                                             \
                memcpy(&a, lengths + j, sizeof a); /* unaligned loads */                         \
                memcpy(&b, lengths + j + W, sizeof b);                                           \
                memcpy(&mid, offsets + j + W, sizeof mid);                                       \
                memcpy(&hi, offsets + j + 2 * W, sizeof hi);                                     \
                or0 |= a; or1 |= b;                                                              \
                neg0 |= lo; neg1 |= mid;                                                         \
                mm0 |= (SHIFT1(lo, mid) - lo) ^ a;                                               \
                mm1 |= (SHIFT1(mid, hi) - mid) ^ b;                                              \
                lo = hi;                                                                         \
            }                                                                                    \
        }                                                                                        \
        for (; j < n; j++) {                                                                     \
            acc |= (uint64_t)lengths[j];                                                         \
            negative |= (uint64_t)offsets[j];                                                    \
            mismatch |= ((uint64_t)offsets[j + 1] - (uint64_t)offsets[j]) ^ (uint64_t)lengths[j];\
        }                                                                                        \
        or0 |= or1; neg0 |= neg1; mm0 |= mm1;                                                    \
        for (int i = 0; i < W; i++) {                                                            \
            acc |= or0[i];                                                                       \
            negative |= neg0[i];                                                                 \
            mismatch |= mm0[i];                                                                  \
        }                                                                                        \
        if (mismatch != 0 || max_length < 0 || ((acc | negative) >> 63)) return 1;              \
        if (acc > (uint64_t)max_length) return 1;                                                \
        RECSYS_SUMS_FROM_BOUNDS                                                                  \
        return 0;                                                                                \
    }
#define RECSYS_SUMS_FROM_OFFSETS_I64_VEC(NAME, ATTR, V, W, SHIFT1)                               \
    ATTR static int64_t NAME(const int64_t *offsets, int64_t num_keys, int64_t stride,          \
                             int64_t max_length, int64_t *sums) {                                \
        const int64_t n = num_keys * stride;                                                     \
        V neg0 = {0}, neg1 = {0}, lo, mid, hi;                                                   \
        uint64_t negative = (uint64_t)offsets[n];                                                \
        int64_t j = 0;                                                                           \
        if (n + 1 >= 3 * W) {                                                                    \
            memcpy(&lo, offsets, sizeof lo);                                                     \
            for (; j + 3 * W <= n + 1; j += 2 * W) {                                             \
                memcpy(&mid, offsets + j + W, sizeof mid);                                       \
                memcpy(&hi, offsets + j + 2 * W, sizeof hi);                                     \
                neg0 |= lo | (SHIFT1(lo, mid) - lo);                                             \
                neg1 |= mid | (SHIFT1(mid, hi) - mid);                                           \
                lo = hi;                                                                         \
            }                                                                                    \
        }                                                                                        \
        for (; j < n; j++)                                                                       \
            negative |= (uint64_t)offsets[j] | ((uint64_t)offsets[j + 1] - (uint64_t)offsets[j]);\
        neg0 |= neg1;                                                                            \
        for (int i = 0; i < W; i++) negative |= neg0[i];                                         \
        if (offsets[0] != 0 || (negative >> 63) || max_length < 0) return 1;                     \
        if (offsets[n] > max_length) return 1;                                                   \
        RECSYS_SUMS_FROM_BOUNDS                                                                  \
        return 0;                                                                                \
    }

#if RECSYS_VECTORS
#if RECSYS_X86_DISPATCH
RECSYS_SUMS_WITH_OFFSETS_I64_VEC(recsys_key_sums_offsets_i64_512, RECSYS_AVX512, recsys_v8u64, 8,
                                 RECSYS_SHIFT1_8)
RECSYS_SUMS_FROM_OFFSETS_I64_VEC(recsys_key_sums_from_offsets_i64_512, RECSYS_AVX512,
                                 recsys_v8u64, 8, RECSYS_SHIFT1_8)
RECSYS_SUMS_WITH_OFFSETS_I64_VEC(recsys_key_sums_offsets_i64_256, RECSYS_AVX2, recsys_v4u64, 4,
                                 RECSYS_SHIFT1_4)
RECSYS_SUMS_FROM_OFFSETS_I64_VEC(recsys_key_sums_from_offsets_i64_256, RECSYS_AVX2,
                                 recsys_v4u64, 4, RECSYS_SHIFT1_4)
#endif
RECSYS_SUMS_WITH_OFFSETS_I64_VEC(recsys_key_sums_offsets_i64_128, , recsys_v2u64, 2,
                                 RECSYS_SHIFT1_2)
RECSYS_SUMS_FROM_OFFSETS_I64_VEC(recsys_key_sums_from_offsets_i64_128, , recsys_v2u64, 2,
                                 RECSYS_SHIFT1_2)

int64_t recsys_key_sums_offsets_i64(const int64_t *lengths, const int64_t *offsets,
                                    int64_t num_keys, int64_t stride, int64_t max_length,
                                    int64_t *sums) {
    return RECSYS_PICK(recsys_key_sums_offsets_i64)(lengths, offsets, num_keys, stride,
                                                     max_length, sums);
}

int64_t recsys_key_sums_from_offsets_i64(const int64_t *offsets, int64_t num_keys, int64_t stride,
                                         int64_t max_length, int64_t *sums) {
    return RECSYS_PICK(recsys_key_sums_from_offsets_i64)(offsets, num_keys, stride, max_length,
                                                          sums);
}
#else
RECSYS_SUMS_WITH_OFFSETS(recsys_key_sums_offsets_i64, int64_t, uint64_t)
RECSYS_SUMS_FROM_OFFSETS(recsys_key_sums_from_offsets_i64, int64_t, uint64_t)
#endif
RECSYS_SUMS_WITH_OFFSETS(recsys_key_sums_offsets_i32, int32_t, uint32_t)
RECSYS_SUMS_FROM_OFFSETS(recsys_key_sums_from_offsets_i32, int32_t, uint32_t)

/* recsys_offsets_diff_{i64,i32}: lengths[j] = offsets[j + 1] - offsets[j] for j < n, the lengths
 * of a KJT or JaggedTensor given only offsets (torch's int64 subtraction of the two shifted
 * views took 68 us for 106k offsets on one thread; this loop vectorizes: 26 us, most of it
 * writing the new tensor). */
#define RECSYS_OFFSETS_DIFF(NAME, T, UT)                                                         \
    RECSYS_CLONES void NAME(const T *offsets, T *lengths, int64_t n) {                           \
        for (int64_t j = 0; j < n; j++) lengths[j] = (T)((UT)offsets[j + 1] - (UT)offsets[j]);  \
    }
RECSYS_OFFSETS_DIFF(recsys_offsets_diff_i64, int64_t, uint64_t)
RECSYS_OFFSETS_DIFF(recsys_offsets_diff_i32, int32_t, uint32_t)

/* KeyedJaggedTensor.permute on the host. A KJT is key-major, so a permute is a gather of one
 * contiguous block per output key from each of lengths, values and (optionally) weights. torch.cat
 * of per-key slices costs a dispatch and a thread-pool hand-off per slice (on 26 keys more than
 * the copy itself); here it is one copy loop per block on the caller's thread.
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
/* One block's copy where the CPU has AVX2: 128 bytes per step through four 32-byte vectors
 * (as fast as 64-byte ones with AVX-512, much faster than those without), then memcpy for the
 * rest; elsewhere memcpy. glibc's memcpy (AVX-512 EPYC, Debian 12) copied
 * the reversed blocks of a 26-key permute (8.9 MB) in 730-830 us against 500 for the same blocks
 * in order, likely its REP MOVSB path meeting source/destination offsets it handles slowly;
 * this loop took 500-550 for both. */
#if RECSYS_VECTORS && RECSYS_X86_DISPATCH
RECSYS_AVX2 static void recsys_copy_wide(char *dst, const char *src, size_t n) {
    recsys_v32c a, b, c, d;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        memcpy(&a, src + i, 32);
        memcpy(&b, src + i + 32, 32);
        memcpy(&c, src + i + 64, 32);
        memcpy(&d, src + i + 96, 32);
        memcpy(dst + i, &a, 32);
        memcpy(dst + i + 32, &b, 32);
        memcpy(dst + i + 64, &c, 32);
        memcpy(dst + i + 96, &d, 32);
    }
    if (i < n) memcpy(dst + i, src + i, n - i);
}

static void recsys_copy(char *dst, const char *src, size_t n) {
    if (recsys_vector_level() > 0)
        recsys_copy_wide(dst, src, n);
    else
        memcpy(dst, src, n);
}
#else
static void recsys_copy(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }
#endif

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
            if (bytes > 0) recsys_copy(dst, src + start[order[j]] * row_bytes, (size_t)bytes);
            dst += bytes;
        }
    }
    return 0;
}

/* recsys_copy_column_runs(meta): the column-run copies of recsys_core.kernels.packed (a
 * table-wise output dist's received chunks into feature order, and its gradient back), meta
 * int64:
 *   [0] rows  [1] R runs  [2] direction: 0 parts -> wide, 1 wide -> parts
 *   [3] wide address  [4] wide row stride in bytes
 *   then 5 per run: part address, part row stride in bytes, the run's byte offset in a part
 *                   row, its byte offset in a wide row, its bytes
 * Row by row, every run of a row before the next row: each wide row is read or written once,
 * front to back. One strided slice copy per run over all rows (torch's copy_) came back to each
 * row R times; on 2048 x 3328 fp32 from two chunks in 26 runs it took 4.8 ms, this loop 1.8
 * (AVX-512 EPYC, one thread). The caller checked that every run lies inside its rows. */
int64_t recsys_copy_column_runs(const int64_t *meta) {
    const int64_t rows = meta[0], R = meta[1], to_parts = meta[2];
    char *wide = (char *)(intptr_t)meta[3];
    const int64_t wide_stride = meta[4];
    const int64_t *run = meta + 5;
    if (rows < 0 || R < 0) return 1;
    for (int64_t i = 0; i < rows; i++) {
        char *w = wide + i * wide_stride;
        for (int64_t k = 0; k < R; k++) {
            const int64_t *q = run + 5 * k;
            char *p = (char *)(intptr_t)q[0] + i * q[1] + q[2];
            if (q[4] <= 0) continue;
            if (to_parts)
                recsys_copy(p, w + q[3], (size_t)q[4]);
            else
                recsys_copy(w + q[3], p, (size_t)q[4]);
        }
    }
    return 0;
}

/* key_sums(address, element_size, num_keys, stride, max_length[, offsets_address])
 *   -> (sums, offsets) | None
 *
 * With offsets_address (a live host tensor of num_keys * stride + 1 entries of the same element
 * size): address 0 means offsets only (recsys_key_sums_from_offsets_*), else both were given
 * and must agree (recsys_key_sums_offsets_*).
 *
 * The same pass as recsys_key_sums_{i64,i32} over `num_keys * stride` lengths at `address`
 * (element_size 8 or 4), for callers on Python's side: the per-key sums and their running
 * offsets (num_keys + 1 entries, from 0) as two lists, built here instead of through ctypes and
 * a Python loop. None when a length is not proven in range (the caller's exact checks then name
 * it). The caller passes the address of a live, contiguous host tensor of that many lengths. */
static PyObject *py_key_sums(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5 && nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "key_sums takes 5 or 6 integer arguments");
        return NULL;
    }
    const uintptr_t address = (uintptr_t)PyLong_AsUnsignedLongLong(args[0]);
    const long long element_size = PyLong_AsLongLong(args[1]);
    const long long num_keys = PyLong_AsLongLong(args[2]);
    const long long stride = PyLong_AsLongLong(args[3]);
    const long long max_length = PyLong_AsLongLong(args[4]);
    const uintptr_t offsets = nargs == 6 ? (uintptr_t)PyLong_AsUnsignedLongLong(args[5]) : 0;
    if (PyErr_Occurred()) return NULL;
    if ((element_size != 8 && element_size != 4) || num_keys < 1 || stride < 0 ||
        (address == 0 && offsets == 0)) {
        PyErr_SetString(PyExc_ValueError, "key_sums: bad arguments");
        return NULL;
    }
    int64_t small[256];
    int64_t *sums = num_keys <= 256 ? small : PyMem_Malloc((size_t)num_keys * sizeof(int64_t));
    if (sums == NULL) return PyErr_NoMemory();
    /* Lengths only: the sums are proven >= 0 only if no sum can wrap, that is if
     * num_keys * stride lengths of at most max_length each stay below 2^63 (far beyond any real
     * KJT; past it the caller's exact checks and torch's sums take over). With offsets the pass
     * proves the offsets exact running sums, so their differences cannot wrap. */
    int64_t failed = 1;
    if (offsets == 0 && max_length > 0 && stride > 0 &&
        (num_keys > INT64_MAX / stride || num_keys * stride > INT64_MAX / max_length))
        goto proven;
    Py_BEGIN_ALLOW_THREADS
    if (offsets != 0 && address == 0) {
        if (element_size == 8)
            failed = recsys_key_sums_from_offsets_i64((const int64_t *)offsets, num_keys, stride,
                                                      max_length, sums);
        else
            failed = recsys_key_sums_from_offsets_i32((const int32_t *)offsets, num_keys, stride,
                                                      max_length, sums);
    } else if (offsets != 0) {
        if (element_size == 8)
            failed = recsys_key_sums_offsets_i64((const int64_t *)address,
                                                 (const int64_t *)offsets, num_keys, stride,
                                                 max_length, sums);
        else
            failed = recsys_key_sums_offsets_i32((const int32_t *)address,
                                                 (const int32_t *)offsets, num_keys, stride,
                                                 max_length, sums);
    } else if (element_size == 8) {
        failed = recsys_key_sums_i64((const int64_t *)address, num_keys, stride, max_length, sums);
    } else {
        failed = recsys_key_sums_i32((const int32_t *)address, num_keys, stride, max_length, sums);
    }
    Py_END_ALLOW_THREADS
proven:;
    PyObject *result = NULL, *sum_list = NULL, *offset_list = NULL;
    if (failed) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    sum_list = PyList_New((Py_ssize_t)num_keys);
    offset_list = PyList_New((Py_ssize_t)num_keys + 1);
    if (sum_list == NULL || offset_list == NULL) goto done;
    int64_t running = 0;
    PyObject *item = PyLong_FromLongLong(0);
    if (item == NULL) goto done;
    PyList_SET_ITEM(offset_list, 0, item);
    for (long long k = 0; k < num_keys; k++) {
        running += sums[k];
        if ((item = PyLong_FromLongLong(sums[k])) == NULL) goto done;
        PyList_SET_ITEM(sum_list, k, item);
        if ((item = PyLong_FromLongLong(running)) == NULL) goto done;
        PyList_SET_ITEM(offset_list, k + 1, item);
    }
    result = PyTuple_Pack(2, sum_list, offset_list);
done:
    Py_XDECREF(sum_list);
    Py_XDECREF(offset_list);
    if (sums != small) PyMem_Free(sums);
    return result;
}

/* offsets_diff(offsets_address, lengths_address, n, element_size) -> None
 *
 * recsys_offsets_diff_{i64,i32}: the caller passes a live, contiguous host tensor of n + 1
 * offsets and a fresh one of n lengths, of the same element size (8 or 4). */
static PyObject *py_offsets_diff(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "offsets_diff takes 4 integer arguments");
        return NULL;
    }
    const uintptr_t offsets = (uintptr_t)PyLong_AsUnsignedLongLong(args[0]);
    const uintptr_t lengths = (uintptr_t)PyLong_AsUnsignedLongLong(args[1]);
    const long long n = PyLong_AsLongLong(args[2]);
    const long long element_size = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    if ((element_size != 8 && element_size != 4) || n < 0 || offsets == 0 ||
        (lengths == 0 && n > 0)) {
        PyErr_SetString(PyExc_ValueError, "offsets_diff: bad arguments");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (element_size == 8)
        recsys_offsets_diff_i64((const int64_t *)offsets, (int64_t *)lengths, n);
    else
        recsys_offsets_diff_i32((const int32_t *)offsets, (int32_t *)lengths, n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* vector_level([level]) -> int
 *
 * The vector builds in use (2: 64-byte vectors, AVX-512; 1: 32-byte, AVX2; 0: 16-byte); with
 * an argument, switch to that level or the CPU's, whichever is lower, so that tests run every
 * build the machine can. Not thread-safe; for tests only. */
static PyObject *py_vector_level(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "vector_level takes at most one integer argument");
        return NULL;
    }
#if RECSYS_VECTORS && RECSYS_X86_DISPATCH
    if (nargs == 1) {
        const long requested = PyLong_AsLong(args[0]);
        if (requested == -1 && PyErr_Occurred()) return NULL;
        const int cpu = recsys_cpu_vector_level();
        recsys_level = requested < 0 ? 0 : requested < cpu ? (int)requested : cpu;
    }
    return PyLong_FromLong(recsys_vector_level());
#else
    if (nargs == 1 && PyLong_AsLong(args[0]) == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLong(0);
#endif
}

static PyMethodDef native_methods[] = {
    {"vector_level", (PyCFunction)(void (*)(void))py_vector_level, METH_FASTCALL,
     "vector_level([level]) -> int: the vector builds in use (tests may lower it)"},
    {"offsets_diff", (PyCFunction)(void (*)(void))py_offsets_diff, METH_FASTCALL,
     "offsets_diff(offsets_address, lengths_address, n, element_size) -> None"},
    {"key_sums", (PyCFunction)(void (*)(void))py_key_sums, METH_FASTCALL,
     "key_sums(address, element_size, num_keys, stride, max_length[, offsets_address]) -> "
     "(sums, offsets) | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "_native",
    "KJT host passes (per-key sums and range check, offsets to lengths, permute copies) "
    "and column-run copies: "
    "key_sums and offsets_diff from Python, the rest through ctypes",
    -1, native_methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&native_module); }
