/* Criteo TSV rows -> labels, dense ints and categorical ids, in one pass over the bytes.
 *
 * The optional fast path of dlrm_app/data/criteo/parse.py: pyarrow's CSV reader first makes
 * 26 string columns of the hex ids, which are then decoded; this reads every field straight
 * into its number. It accepts only the strict row format (exactly 40 tab-separated fields and
 * a '\n'; label 0 or 1; dense fields empty or -?[0-9]{1,18}; categorical fields empty or 1-8
 * hex digits) and returns -(i + 1) at the first line i that is anything else (a short row, a
 * bad value, a CR, ...): the caller then parses the whole block the general way, which pads
 * short rows and reports bad rows. So whatever this accepts, both paths give the same values.
 *
 * Also here, for the default vocabulary: criteo_count_ids (the counting pass's distinct ids and
 * counts of a block) and criteo_vocab_lookup (the encoding's raw id -> table row lookup).
 *
 * Loaded through ctypes (which releases the GIL); the module object exists only so that the
 * package's build can compile this file as an (optional) extension.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>

#define NUM_DENSE 13
#define NUM_SPARSE 26
#define MAX_DENSE_DIGITS 18
#define MAX_HEX_DIGITS 8

enum { NOT_A_DIGIT = 0xFF };

/* Parses the n lines of buf[0, len) (each ending in '\n'): label[i], dense[i * 13 + f] (row
 * major, missing -> 0) and cats[k * n + i] (one column per feature, missing -> 0). Returns n,
 * or -(i + 1) for the first line i not in the strict format (-(n + 1): bytes after line n). */
int64_t criteo_parse_rows(const char *buf, int64_t len, int64_t n, float *label,
                          int64_t *dense, int64_t *cats) {
    unsigned char hex[256], dec[256]; /* byte -> digit value, or NOT_A_DIGIT */
    for (int c = 0; c < 256; c++) {
        dec[c] = (c >= '0' && c <= '9') ? (unsigned char)(c - '0') : NOT_A_DIGIT;
        hex[c] = dec[c] != NOT_A_DIGIT ? dec[c]
                 : (c >= 'a' && c <= 'f') ? (unsigned char)(c - 'a' + 10)
                 : (c >= 'A' && c <= 'F') ? (unsigned char)(c - 'A' + 10) : NOT_A_DIGIT;
    }
    const unsigned char *p = (const unsigned char *)buf, *end = p + len;
    for (int64_t i = 0; i < n; i++) {
        if (end - p < 2 || (p[0] != '0' && p[0] != '1') || p[1] != '\t') return -(i + 1);
        label[i] = (float)(p[0] - '0');
        p += 2;
        for (int f = 0; f < NUM_DENSE; f++) {
            int negative = p < end && *p == '-';
            p += negative;
            const unsigned char *first = p;
            uint64_t v = 0;
            unsigned d;
            while (p < end && (d = dec[*p]) != NOT_A_DIGIT && p - first < MAX_DENSE_DIGITS) {
                v = v * 10 + d;
                p++;
            }
            /* a 19th digit stops the loop above and fails here: it is not a '\t' */
            if ((negative && p == first) || p == end || *p != '\t') return -(i + 1);
            dense[i * NUM_DENSE + f] = negative ? -(int64_t)v : (int64_t)v;
            p++;
        }
        for (int k = 0; k < NUM_SPARSE; k++) {
            unsigned char stop = k == NUM_SPARSE - 1 ? '\n' : '\t';
            uint64_t v = 0;
            unsigned bad = NOT_A_DIGIT;
            if (end - p > MAX_HEX_DIGITS && p[MAX_HEX_DIGITS] == stop) {
                /* the usual field, 8 digits: decoded without a branch per digit */
                bad = 0;
                for (int j = 0; j < MAX_HEX_DIGITS; j++) {
                    unsigned h = hex[p[j]];
                    bad |= h;
                    v = (v << 4) | (h & 15);
                }
            }
            if (bad & 0x80) { /* any other length (or a short field before a stop byte) */
                const unsigned char *first = p;
                unsigned h;
                v = 0;
                while (p < end && (h = hex[*p]) != NOT_A_DIGIT && p - first < MAX_HEX_DIGITS) {
                    v = (v << 4) | h;
                    p++;
                }
                if (p == end || *p != stop) return -(i + 1);
            } else {
                p += MAX_HEX_DIGITS;
            }
            cats[k * n + i] = (int64_t)v;
            p++;
        }
    }
    return p == end ? n : -(n + 1);
}

/* Number of '\n' bytes in buf[0, len): every block's line count (bytes.count is a byte-at-a-time
 * loop; this one the compiler vectorizes: a chunk's count fits a byte per vector lane). */
int64_t criteo_count_newlines(const char *buf, int64_t len) {
    const unsigned char *p = (const unsigned char *)buf;
    int64_t n = 0;
    while (len > 0) {
        int m = len < 255 ? (int)len : 255;
        unsigned char c = 0;
        for (int i = 0; i < m; i++) c += p[i] == '\n';
        n += c;
        p += m;
        len -= m;
    }
    return n;
}

/* Table rows of raw ids in a sorted vocabulary: out[i] = p + 1 where vocab[p] == raw[i], else 0
 * (the out-of-vocabulary row), as np.searchsorted(vocab, raw) and a compare would give. The
 * search starts from a bucket index on the ids' high bits, first[b] = the first position p with
 * (vocab[p] >> shift) >= b for b in [0, buckets]: the caller sizes it to a few ids a bucket, so
 * a lookup reads one index entry and one or two cache lines of the vocabulary, where a binary
 * search over tens of millions of ids misses the cache at every step. Ids the index does not
 * cover (negative, or past the last bucket: above every vocabulary id) are not in it. */
void criteo_vocab_lookup(const int64_t *vocab, const int64_t *first, int64_t buckets, int shift,
                         const int64_t *raw, int64_t n, int64_t *out) {
    /* In groups: the index entries of a group are fetched together, then the vocabulary
     * lines they point at, so that the cache misses of a group overlap (prefetches). */
    enum { GROUP = 32 };
    int64_t lo[GROUP], hi[GROUP];
    for (int64_t g = 0; g < n; g += GROUP) {
        int m = n - g < GROUP ? (int)(n - g) : GROUP;
        const int64_t *x = raw + g;
        for (int j = 0; j < m; j++) {
            uint64_t b = (uint64_t)x[j] >> shift;
            if (x[j] >= 0 && b < (uint64_t)buckets) __builtin_prefetch(first + b);
        }
        for (int j = 0; j < m; j++) {
            uint64_t b = (uint64_t)x[j] >> shift;
            if (x[j] < 0 || b >= (uint64_t)buckets) {
                lo[j] = hi[j] = 0; /* not in the vocabulary */
                continue;
            }
            lo[j] = first[b];
            hi[j] = first[b + 1];
            __builtin_prefetch(vocab + lo[j]);
        }
        for (int j = 0; j < m; j++) {
            /* lower bound of x[j] in vocab[lo, hi), without a branch on the ids */
            const int64_t *base = vocab + lo[j];
            int64_t len = hi[j] - lo[j];
            if (len == 0) {
                out[g + j] = 0;
                continue;
            }
            while (len > 1) {
                int64_t half = len >> 1;
                base = base[half - 1] < x[j] ? base + half : base;
                len -= half;
            }
            int64_t a = (base - vocab) + (*base < x[j]);
            out[g + j] = a < hi[j] && vocab[a] == x[j] ? a + 1 : 0;
        }
    }
}

/* Distinct ids of ids[0, n) with their counts, for the vocabulary's counting pass: writes
 * (id << 32 | count) for each distinct id to out[0, d) in no particular order (the caller sorts
 * them) and returns d; -1 if an id is outside [0, 2^32) (raw ids have at most 8 hex digits: the
 * caller counts such input another way), -2 if memory ran out. A hash table sized to the
 * distinct ids seen (doubled when half full), where a sort of all n ids would move every id
 * several times: a block's ids repeat (a few ids fill most rows). */
static int64_t count_insert(uint64_t *table, uint64_t mask, int bits, uint64_t key,
                            uint64_t count) {
    uint64_t h = (key * 0x9E3779B97F4A7C15ull) >> (64 - bits);
    for (;; h = (h + 1) & mask) {
        uint64_t slot = table[h];
        if (slot == 0) {
            table[h] = key << 32 | count;
            return 1; /* a new id */
        }
        if (slot >> 32 == key) {
            table[h] = slot + count;
            return 0;
        }
    }
}

int64_t criteo_count_ids(const int64_t *ids, int64_t n, uint64_t *out) {
    int bits = 10;
    uint64_t size = (uint64_t)1 << bits, mask = size - 1;
    uint64_t *table = calloc(size, sizeof *table); /* 0: empty (a held count is >= 1) */
    int64_t d = 0;
    if (table == NULL) return -2;
    if ((uint64_t)n > UINT32_MAX) { /* a count could overflow into its id */
        free(table);
        return -1;
    }
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] > (int64_t)UINT32_MAX) {
            free(table);
            return -1;
        }
        d += count_insert(table, mask, bits, (uint64_t)ids[i], 1);
        if ((uint64_t)d * 2 > size) { /* half full: double, re-inserting the held counts */
            uint64_t *old = table, old_size = size;
            bits++;
            size <<= 1;
            mask = size - 1;
            table = calloc(size, sizeof *table);
            if (table == NULL) {
                free(old);
                return -2;
            }
            for (uint64_t j = 0; j < old_size; j++)
                if (old[j]) count_insert(table, mask, bits, old[j] >> 32, old[j] & UINT32_MAX);
            free(old);
        }
    }
    int64_t k = 0;
    for (uint64_t j = 0; j < size; j++)
        if (table[j]) out[k++] = table[j];
    free(table);
    return k;
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_fastparse", .m_size = -1};

PyMODINIT_FUNC PyInit__fastparse(void) { return PyModule_Create(&module); }
