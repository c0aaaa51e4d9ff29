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
 * Loaded through ctypes (which releases the GIL); the module object exists only so that the
 * package's build can compile this file as an (optional) extension.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

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

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_fastparse", .m_size = -1};

PyMODINIT_FUNC PyInit__fastparse(void) { return PyModule_Create(&module); }
